"""Builds the C kernel (``csrc/quant.c``) with the system's C compiler into a per-user cache.

Why compile at first use rather than at install time: the kernel is built with
``-march=native`` for the CPU it runs on, needs no Python headers and no build backend
beyond a plain ``cc``, and a machine without a compiler still gets the same bytes from the
torch path. The sources ship as package data (``checkflow/codec/csrc``); the cached library's
name hashes the sources, the flags, the compiler and the CPU's features, so an edited source
or another machine never picks up a stale build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

SOURCES = ("quant.c", "quant_dtype.h")
"""The kernel's files in ``checkflow/codec/csrc``; ``quant.c`` includes the header."""
FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
"""No fast-math and no FMA contraction: every float op must round exactly like torch's."""
ENV_CACHE = "CHECKFLOW_CACHE_DIR"


class BuildError(RuntimeError):
    """The kernel could not be compiled (no compiler, or the compiler failed)."""


def kernel_sources() -> dict[str, str]:
    """The kernel's source files by name, read from the installed package's data."""
    root = resources.files("checkflow.codec").joinpath("csrc")
    try:
        return {name: root.joinpath(name).read_text(encoding="utf-8") for name in SOURCES}
    except OSError as e:
        raise BuildError(
            f"kernel source missing from the installed package ({e}); reinstall checkflow "
            "(pip install -e .) so that checkflow/codec/csrc is included"
        ) from e


def cache_dir() -> Path:
    root = os.environ.get(ENV_CACHE) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "checkflow"
    )
    return Path(root)


def _cpu_key() -> str:
    """The CPU's feature flags: a kernel built with -march=native must not run elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _build(compiler: str, flags: list[str], sources: dict[str, str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for name, text in sources.items():
            (Path(tmp) / name).write_text(text, encoding="utf-8")
        out = Path(tmp) / "quant.so"
        proc = subprocess.run(
            [compiler, *flags, str(Path(tmp) / SOURCES[0]), "-o", str(out), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise BuildError(f"{compiler} failed: {proc.stderr.strip()[:2000]}")
        # Atomic: concurrent processes may build the same kernel; the last rename wins.
        os.replace(out, target)


def compile_kernel() -> Path:
    """Path of the compiled kernel, building it unless the cache already holds it.

    Raises:
        BuildError: no C compiler on PATH (or in ``$CC``), or every build attempt failed.
    """
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise BuildError("no C compiler (cc/gcc) on PATH")
    sources = kernel_sources()
    errors = []
    # -march=native vectorizes with the machine's widest units; the plain build is the
    # fallback for compilers that reject it. Results are identical: no FMA contraction.
    for flags in ([*FLAGS, "-march=native"], FLAGS):
        key = "".join(sources.values()) + " ".join(flags) + compiler + _cpu_key()
        target = cache_dir() / f"quant-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
        if target.exists():
            return target
        try:
            _build(compiler, flags, sources, target)
            return target
        except (BuildError, OSError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    raise BuildError("; ".join(errors))
