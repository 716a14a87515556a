"""The kernel cache cannot be planted (issue 31). User ``nobody`` puts a library under the
kernel's computable name, with a constructor that writes a marker file when it is loaded;
root's q8 and delta encodes (a fresh interpreter each) never load it: a cache folder that
another user owns or can write is not used, a cached library whose bytes do not hash to the
recorded build is rebuilt, and a library that does not load falls back to the torch path
with one warning. Every result is the same bytes as the torch path's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checkflow.codec import _build
from tests.codec.test_native_build import _CHAIN
from tests.support.paths import REPO

NOBODY = 65534

pytestmark = [
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler"),
    pytest.mark.skipif(os.geteuid() != 0, reason="chown to nobody needs root"),
    pytest.mark.slow,  # fresh interpreters importing torch
]

_EVIL = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(MARKER, "w");
    if (f) { fputs("ran as the victim", f); fclose(f); }
}
int q_encode_f32(void) { return 0; }
"""


def chain(cache: Path, tmp: Path, **env: str) -> tuple[bool, str, str]:
    """The q8 + delta chain of test_native_build in a fresh interpreter: whether the kernel
    loaded, the digest of every byte written, and the warnings it logged."""
    tmp.mkdir(exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-c", _CHAIN],
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            _build.ENV_CACHE: str(cache),
            "TMPDIR": str(tmp),
            **env,
        },  # fmt: skip
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    loaded, digest = proc.stdout.split()
    return loaded == "True", digest, proc.stderr


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, str]:
    """The torch path's digest, and the kernel's name in a cache (the same on any cache)."""
    root = tmp_path_factory.mktemp("reference")
    loaded, digest, _ = chain(root / "none", root / "tmp", CHECKFLOW_NATIVE="0")
    assert not loaded
    os.environ[_build.ENV_CACHE] = str(root / "private")
    try:
        name = _build.compile_kernel().name
    finally:
        del os.environ[_build.ENV_CACHE]
    return digest, name


def planted_library(tmp_path: Path, marker: Path, target: Path) -> None:
    source = tmp_path / "evil.c"
    source.write_text(_EVIL)
    cc = ["cc", "-shared", "-fPIC", f'-DMARKER="{marker}"', str(source), "-o", str(target)]
    subprocess.run(cc, check=True, timeout=60)
    # The hash file too: anyone can compute the sha256 of what they plant.
    _build._hash_file(target).write_text(_build._sha256(target))


def test_a_library_planted_by_nobody_in_a_shared_cache_is_never_loaded(tmp_path, reference):
    digest, name = reference
    shared, marker = tmp_path / "shared", tmp_path / "marker"
    shared.mkdir()
    planted_library(tmp_path, marker, shared / name)
    for path in (shared, shared / name, _build._hash_file(shared / name)):
        os.chown(path, NOBODY, NOBODY)
    os.chmod(shared, 0o1777)

    loaded, got, log = chain(shared, tmp_path / "tmp")
    assert not marker.exists(), "the planted constructor ran"
    assert loaded and got == digest, "a kernel built privately, the same bytes"
    warned = [line for line in log.splitlines() if "kernel cache folder" in line]
    assert len(warned) == 1 and "owned by uid 65534" in warned[0], log
    assert sorted(p.name for p in shared.iterdir()) == sorted([name, name + ".sha256"])
    assert not list((tmp_path / "tmp").iterdir()), "the private build folder is removed"


def test_a_cache_folder_of_this_user_that_others_can_write_is_not_used(tmp_path, reference):
    digest, name = reference
    shared, marker = tmp_path / "shared", tmp_path / "marker"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    planted_library(tmp_path, marker, shared / name)

    loaded, got, log = chain(shared, tmp_path / "tmp")
    assert not marker.exists() and loaded and got == digest
    assert "writable by group or others (mode 0777)" in log


def test_a_library_that_no_longer_matches_its_recorded_hash_is_rebuilt(tmp_path, reference):
    digest, name = reference
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    assert chain(cache, tmp_path / "tmp")[:2] == (True, digest)
    recorded = _build._hash_file(cache / name).read_text()
    planted_library(tmp_path, marker, tmp_path / "evil.so")
    shutil.copyfile(tmp_path / "evil.so", cache / name)  # the hash file is left as built

    loaded, got, log = chain(cache, tmp_path / "tmp")
    assert not marker.exists(), "a library that fails its hash is never opened"
    assert loaded and got == digest and "does not match the hash" in log
    assert _build._sha256(cache / name) == recorded, "rebuilt: the kernel's own bytes again"


def test_a_library_of_another_owner_in_a_private_cache_is_rebuilt(tmp_path, reference):
    digest, name = reference
    cache, marker = tmp_path / "cache", tmp_path / "marker"
    cache.mkdir(mode=0o700)
    planted_library(tmp_path, marker, cache / name)  # its hash file matches
    os.chown(cache / name, NOBODY, NOBODY)

    loaded, got, _ = chain(cache, tmp_path / "tmp")
    assert not marker.exists() and loaded and got == digest


@pytest.mark.parametrize("library", ["garbage", "no-kernel-symbols"])
def test_a_library_that_does_not_load_falls_back_to_torch_with_one_warning(
    tmp_path, reference, library
):
    """A library with the right name and a matching hash (this user's own doing, or a
    damaged build) that is not an ELF file, or has not the kernel's functions."""
    digest, name = reference
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if library == "garbage":
        (cache / name).write_bytes(b"\x7fELF not really" * 100)
        _build._hash_file(cache / name).write_text(_build._sha256(cache / name))
    else:
        planted_library(tmp_path, tmp_path / "loaded", cache / name)

    loaded, got, log = chain(cache, tmp_path / "tmp")
    assert not loaded and got == digest, "the torch path, the same bytes"
    warned = [line for line in log.splitlines() if "kernel unavailable" in line]
    assert len(warned) == 1, log
    assert "Traceback" not in log
