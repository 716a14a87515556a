"""How the C kernel is found and built: its sources ship with the package, the build is
cached by content, and without a compiler the codecs fall back to torch ops, same bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkflow.codec import _build
from tests.support.paths import REPO

needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)

# A q8 and a delta chain, with the native kernel when it loads; prints whether it did and a
# digest of every byte written.
_CHAIN = """
import hashlib, torch
from checkflow.codec import _native
from checkflow.codec.delta import DeltaCodec
from checkflow.codec.quant import Q8Codec
h = hashlib.sha256()
for codec in (Q8Codec(), DeltaCodec()):
    g = torch.Generator().manual_seed(0)
    x, ref = torch.randn(64, 300, generator=g), None
    for _ in range(4):
        enc, ref = codec.encode(x, ref)
        for part in enc.data:
            h.update(bytes(memoryview(part)))
        x = x + 0.01 * torch.randn(64, 300, generator=g)
print(_native.load() is not None, h.hexdigest())
"""


def _run_chain(cache: Path, **env: str) -> tuple[str, str]:
    out = subprocess.run(
        [sys.executable, "-c", _CHAIN],
        env={**os.environ, "PYTHONPATH": str(REPO), _build.ENV_CACHE: str(cache), **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    loaded, digest = out.stdout.split()
    return loaded, digest


def test_the_kernel_sources_ship_in_the_package_and_quant_c_includes_the_dtype_template():
    sources = _build.kernel_sources()
    assert set(sources) == {"quant.c", "quant_dtype.h"}
    main = sources["quant.c"]
    assert main.count('#include "quant_dtype.h"') == 3  # float32, bfloat16, float16
    assert "int NAME(q_encode)" in sources["quant_dtype.h"]


@needs_cc
def test_the_built_library_is_cached_under_a_name_that_hashes_its_sources(tmp_path, monkeypatch):
    monkeypatch.setenv(_build.ENV_CACHE, str(tmp_path))
    first = _build.compile_kernel()
    assert first.parent == tmp_path and first.exists()
    mtime = first.stat().st_mtime_ns
    assert _build.compile_kernel() == first and first.stat().st_mtime_ns == mtime  # reused

    edited = {**_build.kernel_sources()}
    edited["quant.c"] += "\n/* edited */\n"
    monkeypatch.setattr(_build, "kernel_sources", lambda: edited)
    second = _build.compile_kernel()
    assert second != first and second.exists()  # an edited source never reuses a stale build


@needs_cc
@pytest.mark.slow  # two fresh interpreters importing torch
def test_without_a_compiler_the_codecs_use_torch_ops_and_write_the_same_bytes(tmp_path):
    native = _run_chain(tmp_path / "with-cc")
    fallback = _run_chain(tmp_path / "no-cc", CC=str(tmp_path / "no-such-compiler"))

    assert native[0] == "True" and fallback[0] == "False"
    assert fallback[1] == native[1]
    assert not (tmp_path / "no-cc").exists() or not any((tmp_path / "no-cc").iterdir())
