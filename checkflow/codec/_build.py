"""Builds the C kernel (``csrc/quant.c``) with the system's C compiler into a per-user cache.

Why compile at first use rather than at install time: the kernel is built with
``-march=native`` for the CPU it runs on, needs no Python headers and no build backend
beyond a plain ``cc``, and a machine without a compiler still gets the same bytes from the
torch path. The sources ship as package data (``checkflow/codec/csrc``); the cached library's
name hashes the sources, the flags, the compiler and the CPU's features, so an edited source
or another machine never picks up a stale build.

The cache is where other users could plant a library under that computable name, which
would then run as this user (issue 31). So the cache folder is used only when it is this
user's and writable by no one else (:func:`checkflow.folders.private_folder`), else the
kernel is built in a fresh private temporary folder, with one warning. Each build records
the sha256 of the library beside it (``quant-*.so.sha256``), and a cached library is
loaded only when its bytes still hash to that; otherwise it is rebuilt.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

from checkflow.folders import UnsafeFolderError, private_folder

logger = logging.getLogger(__name__)

SOURCES = ("quant.c", "quant_dtype.h")
"""The kernel's files in ``checkflow/codec/csrc``; ``quant.c`` includes the header."""
FLAGS = ["-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=gnu11"]
"""No fast-math and no FMA contraction: every float op must round exactly like torch's."""
ENV_CACHE = "CHECKFLOW_CACHE_DIR"
HASH_SUFFIX = ".sha256"
"""Beside each cached library: the sha256 of its bytes when it was built."""
_temporary: set[Path] = set()


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
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for name, text in sources.items():
            (Path(tmp) / name).write_text(text, encoding="utf-8")
        # Relative names in the folder: the library then holds no random path, and two
        # processes building the same kernel write the same bytes (and the same hash).
        proc = subprocess.run(
            [compiler, *flags, SOURCES[0], "-o", "quant.so", "-lm"],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise BuildError(f"{compiler} failed: {proc.stderr.strip()[:2000]}")
        out = Path(tmp) / "quant.so"
        digest = Path(tmp) / "quant.so.sha256"
        digest.write_text(_sha256(out))
        # Atomic: concurrent processes may build the same kernel; the last rename wins.
        os.replace(digest, _hash_file(target))
        os.replace(out, target)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hash_file(library: Path) -> Path:
    return library.with_name(library.name + HASH_SUFFIX)


def verified(library: Path) -> bool:
    """Whether ``library`` is a plain file of this user's, writable by no one else, whose
    bytes hash to the sha256 recorded when it was built."""
    try:
        st = os.lstat(library)
        recorded = _hash_file(library).read_text().strip()
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return False
    return bool(recorded) and _sha256(library) == recorded


def build_folder() -> Path:
    """The cache folder, made private (mode 0700) when it is new; a fresh private temporary
    folder, with a warning, when it exists and another user owns it or can write it."""
    folder = cache_dir()
    try:
        return Path(private_folder(str(folder), what="kernel cache folder"))
    except UnsafeFolderError as e:
        temporary = Path(tempfile.mkdtemp(prefix="checkflow-kernel-"))
        _temporary.add(temporary)
        logger.warning("%s; building the kernel in %s instead", e, temporary)
        return temporary


def forget(library: Path) -> None:
    """Remove ``library``'s folder if it is a temporary one of :func:`build_folder` (once
    the library is loaded, or failed to: it is not reused)."""
    if library.parent in _temporary:
        _temporary.discard(library.parent)
        shutil.rmtree(library.parent, ignore_errors=True)


def compile_kernel() -> Path:
    """Path of the compiled kernel, building it unless the cache already holds it, its
    bytes verified against the hash recorded at its build.

    Raises:
        BuildError: no C compiler on PATH (or in ``$CC``), or every build attempt failed.
    """
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise BuildError("no C compiler (cc/gcc) on PATH")
    sources = kernel_sources()
    folder = build_folder()
    errors = []
    # -march=native vectorizes with the machine's widest units; the plain build is the
    # fallback for compilers that reject it. Results are identical: no FMA contraction.
    for flags in ([*FLAGS, "-march=native"], FLAGS):
        key = "".join(sources.values()) + " ".join(flags) + compiler + _cpu_key()
        target = folder / f"quant-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
        if verified(target):
            return target
        if os.path.lexists(target):
            logger.warning("%s does not match the hash recorded at its build; rebuilding", target)
        try:
            _build(compiler, flags, sources, target)
            if verified(target):
                return target
            errors.append(f"{target} changed while it was built")
        except (BuildError, OSError, subprocess.SubprocessError) as e:
            errors.append(str(e))
    raise BuildError("; ".join(errors))
