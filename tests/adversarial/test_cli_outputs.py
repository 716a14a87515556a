"""What ``checkflow`` prints and writes when the checkpoint or the disk is hostile.

- ``restore --out`` (torch, safetensors, dcp) on a full disk and into a read-only folder ends
  in one line and exit 1, and leaves no file at all where it wrote (a temporary name is used
  and removed). The disk is a real tmpfs of a few KiB, mounted in a private mount namespace
  (``unshare -Urm``); where that is not allowed, the full disk is a file-size limit
  (``RLIMIT_FSIZE``, so ``EFBIG``) and the read-only folder a ``chmod 555`` one (not
  read-only for root, so that case needs the namespace).
- Names from a checkpoint holding ESC/BEL reach the terminal escaped, never raw.
- A safetensors restore never unpickles, with or without ``--trust``: no class is looked up
  by any unpickler (``pickle.find_class`` audit events), the planted pickle's shell command
  never runs, and what was left out is said.

Every CLI run is a real subprocess (``python -m checkflow.cli``).
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from checkflow import Checkpointer

EVIL = "\x1b]0;pwned\x07"
"""An xterm "set window title" sequence: printed raw, it retitles the user's terminal."""
ESCAPED = "\\x1b]0;pwned\\x07"

AUDIT = """
import sys
def hook(event, args):
    if event == "pickle.find_class":
        print("UNPICKLED", *args, file=sys.stderr)
from checkflow.cli import main
sys.addaudithook(hook)
sys.exit(main(sys.argv[1:]))
"""
"""Runs the CLI with an audit hook that reports every class any unpickler resolves."""


class Holder:
    """A state object around a plain dict."""

    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return self.value

    def load_state_dict(self, value: dict[str, Any]) -> None:
        self.value = value


class RunsShell:
    """Unpickling it runs ``touch CANARY`` (``posix.system`` in the pickle)."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __deepcopy__(self, memo: dict[int, Any]) -> RunsShell:
        return self  # the Checkpointer's snapshot must not run it at save time

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.canary}",))


def cli(*args: str, cwd: Path | None = None, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", AUDIT, *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=cwd,
        **kw,
    )


def digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def save(root: Path, state: dict[str, Any], **kw: Any) -> None:
    with Checkpointer(str(root), state, every=1, keep=0, **kw) as ck:
        ck.save().result()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 256 KiB checkpoint with no pickles."""
    root = tmp_path_factory.mktemp("plain") / "root"
    save(root, {"model": Holder({"w": torch.arange(65536.0), "b": torch.ones(3)})})
    return root


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A checkpoint whose tensor and object names hold ESC/BEL, with one object stored as a
    pickle that runs a shell command when unpickled; returns (root, canary)."""
    base = tmp_path_factory.mktemp("hostile")
    root, canary = base / "root", base / "canary"
    model = {EVIL: torch.arange(64.0), "w": torch.ones(3)}
    extra = {EVIL: RunsShell(canary), "n": 3}
    save(root, {"model": Holder(model), "extra": Holder(extra)}, allow_pickle=True)
    assert not canary.exists()
    return root, canary


# -- full disk, read-only folder -------------------------------------------------------------
def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"]
    return subprocess.run(probe, capture_output=True).returncode == 0


UNSHARE = _can_unshare()

IN_TMPFS = """
mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 99
shift 2
"$@"
rc=$?
find "$MNT" -mindepth 1 > "$LISTING"
exit $rc
"""
"""Mounts a tmpfs (options $1) on $2, runs the rest, and lists what is left on it."""


def restore_into(tmp_path: Path, root: Path, fmt: str, disk: str) -> tuple[Any, str, list[str]]:
    """``restore --out MNT/out`` where MNT is ``disk`` ("full" or "read-only"); returns the
    run, the expected reason, and every path left under MNT."""
    mnt, listing = tmp_path / "mnt", tmp_path / "listing"
    mnt.mkdir()
    argv = ["restore", str(root), "--out", str(mnt / "out"), "--format", fmt]
    if UNSHARE:
        size = "8k" if disk == "full" else "8k,ro"
        cmd = ["unshare", "-Urm", "sh", "-c", IN_TMPFS, "sh", size, str(mnt)]
        env = {**os.environ, "MNT": str(mnt), "LISTING": str(listing)}
        run = subprocess.run(
            [*cmd, sys.executable, "-c", AUDIT, *argv],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
        )
        left = listing.read_text().split()
        reason = "No space left on device" if disk == "full" else "Read-only file system"
        return run, reason, left
    if disk == "full":
        limit = (8192, 8192)
        run = cli(*argv, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, limit))
        return run, "File too large", [str(p) for p in mnt.rglob("*")]
    if os.geteuid() == 0:
        pytest.skip("root ignores chmod and no mount namespace can be made here")
    mnt.chmod(0o555)
    try:
        run = cli(*argv)
    finally:
        mnt.chmod(0o755)
    return run, "Permission denied", [str(p) for p in mnt.rglob("*")]


@pytest.mark.parametrize("disk", ["full", "read-only"])
@pytest.mark.parametrize("fmt", ["torch", "safetensors", "dcp"])
def test_restore_out_on_a_full_or_read_only_disk_is_one_line_exit_1_and_leaves_nothing(
    fmt: str, disk: str, plain: Path, tmp_path: Path
) -> None:
    before = digest(plain)

    run, reason, left = restore_into(tmp_path, plain, fmt, disk)

    out = tmp_path / "mnt" / "out"
    assert run.returncode == 1, run.stderr
    assert run.stdout == ""
    assert run.stderr == (
        f"checkflow: error: cannot write {out}: {reason}; nothing was written there "
        "(free space, or choose a writable --out)\n"
    )
    assert left == []  # no partial out, no .out.tmp-*, no __0_0.distcp
    assert digest(plain) == before  # the checkpoint read from is untouched


# -- escaped names ---------------------------------------------------------------------------
def test_inspect_escapes_names_holding_esc_and_bel(hostile: tuple[Path, Path]) -> None:
    root, canary = hostile

    run = cli("inspect", str(root))

    assert (run.returncode, run.stderr) == (0, "")
    assert "\x1b" not in run.stdout and "\x07" not in run.stdout
    rows = [r.split() for r in run.stdout.splitlines()]
    assert ["model." + ESCAPED, "float32", "[64]", "exact", "-", "256", "B", "1"] in rows
    (obj,) = [line for line in run.stdout.splitlines() if line.startswith("extra." + ESCAPED)]
    assert obj.endswith(f"-byte pickle of {RunsShell.__module__}.RunsShell>")
    assert not canary.exists()


def test_inspect_json_keeps_the_real_name_as_a_json_escape(hostile: tuple[Path, Path]) -> None:
    root, _ = hostile

    run = cli("inspect", str(root), "--json")

    assert (run.returncode, run.stderr) == (0, "")
    assert "\x1b" not in run.stdout and "\x07" not in run.stdout
    assert "\\u001b]0;pwned\\u0007" in run.stdout  # JSON's own escape, so it parses back
    texts: list[str] = []

    def collect(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        texts.extend(str(part) for pair in pairs for part in pair)
        return dict(pairs)

    json.loads(run.stdout, object_pairs_hook=collect)
    assert any(f"model.{EVIL}" in text for text in texts)  # parses back to the real name


def test_verify_names_a_damaged_tensor_escaped(hostile: tuple[Path, Path], tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(hostile[0], root)
    chunks = next(root.glob("step-*/rank-00000-*.chunks"))
    data = bytearray(chunks.read_bytes())
    data[0] ^= 0xFF  # the first bytes are the first tensor's: model.<EVIL>
    chunks.write_bytes(bytes(data))

    run = cli("verify", str(root))

    assert run.returncode == 1
    both = run.stdout + run.stderr
    assert "\x1b" not in both and "\x07" not in both
    assert f"model.{ESCAPED}" in both


def test_errors_and_ls_escape_names(hostile: tuple[Path, Path], tmp_path: Path) -> None:
    root, canary = hostile
    refused = cli("restore", str(root), "--out", str(tmp_path / "m.pt"))
    evil_root = tmp_path / f"run{EVIL}"
    evil_root.mkdir()
    listed = cli("ls", str(evil_root))

    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.count("\n") == 1 and "\x1b" not in refused.stderr
    assert f"object 'extra.{ESCAPED}' (" in refused.stderr
    assert "\x1b" not in listed.stdout + listed.stderr
    assert f"run{ESCAPED}" in listed.stdout + listed.stderr
    assert not canary.exists() and not (tmp_path / "m.pt").exists()


# -- safetensors never unpickles -------------------------------------------------------------
@pytest.mark.parametrize("trust", [False, True])
def test_safetensors_restore_never_unpickles_and_says_what_it_left_out(
    trust: bool, hostile: tuple[Path, Path], tmp_path: Path
) -> None:
    root, canary = hostile
    out = tmp_path / "m.safetensors"

    run = cli(
        "restore", str(root), "--out", str(out), "--format", "safetensors", *(["--trust"] * trust)
    )

    assert (run.returncode, run.stderr) == (0, "")  # no UNPICKLED line: no class looked up
    assert not canary.exists()
    assert run.stdout.splitlines()[0] == (
        f"left out of the safetensors file: 1 object(s) stored as pickles (extra.{ESCAPED}); "
        "a safetensors restore never unpickles: use --format torch --trust to keep them"
    )
    assert run.stdout.splitlines()[1].startswith(f"restored step 0 from {root} to {out} (")
    assert len(run.stdout.splitlines()) == 2
    got = load_file(str(out))
    assert set(got) == {f"model.{EVIL}", "model.w", "rng.torch"}
    assert torch.equal(got[f"model.{EVIL}"], torch.arange(64.0))
