"""Crafted chunk bytes: a chunk decodes to at most the size its manifest declares (issue 30).

Each test writes a real checkpoint with a real ``Checkpointer``, replaces one chunk's bytes
with a zstd frame that lies (checksum recomputed, as an attacker would), and asserts the
exact outcome: the error naming step, rank, tensor, file and section, ``verify``'s exit
code and one line, the step ``restore()`` falls back to with its exact tensors, the good
steps' files byte for byte, and the peak memory of a reader in a child process.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash
import zstandard

from checkflow import Checkpointer, load
from checkflow import manifest as mf
from checkflow.codec import CodecError, get_codec
from checkflow.restore import CorruptCheckpointError

W = "model.weight"
DECLARED = 64 * 64 * 4
"""The weight chunk of ``Linear(64, 64)``: 16 KiB, each of its 4 byte planes 4 KiB."""
PLANE = DECLARED // 4
BOMB = 256 << 20
"""What the lying frames decode to (or say they do): 16,384 times the declared size."""
TIB = 1 << 40
FILE = "rank-00000-000.chunks"


def claims_1_tib() -> bytes:
    """16 bytes: magic, descriptor 0xE0 (single segment, 8-byte content size), 2**40, an
    empty last raw block. python-zstandard's ``decompress`` allocates the 1 TiB."""
    return bytes.fromhex("28b52ffd") + b"\xe0" + TIB.to_bytes(8, "little") + b"\x01\x00\x00"


@cache
def _zeros_frame(content_size: bool) -> bytes:
    """``BOMB`` zero bytes as one level-1 frame (a 512 KiB window, which passes the window
    cap), streamed so that the test itself never holds them; with or without the size."""
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=content_size)
    cobj = cctx.compressobj(size=BOMB if content_size else -1)
    zeros = bytes(1 << 20)
    return b"".join(cobj.compress(zeros) for _ in range(BOMB >> 20)) + cobj.flush()


def states_256_mib() -> bytes:
    return _zeros_frame(True)


def bomb() -> bytes:
    """A frame that states no size and decodes to 256 MiB: only the output bound stops it."""
    return _zeros_frame(False)


def understated(n: int) -> bytes:
    return zstandard.ZstdCompressor().compress(b"\x01" * n)


# -- a real checkpoint, and one chunk replaced ----------------------------------------------------
def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(64, 64)}


def _write(root: Path, codec: str, steps: int = 2) -> list[dict[str, torch.Tensor]]:
    """``steps`` committed steps of ``Linear(64, 64)``; 8 of the weight's 64 rows change
    between steps, so an incremental codec stores step 2 as a delta on step 1."""
    state = _state()
    saved = []
    with Checkpointer(str(root), state, every=1, keep=0, codec=codec) as ck:
        for _ in range(steps):
            with torch.no_grad():
                state["model"].weight[:8].add_(1.0)
            future = ck.step()
            assert future is not None
            future.result()
            saved.append({k: v.clone() for k, v in state["model"].state_dict().items()})
    return saved


def _rpath(root: Path, step: int) -> Path:
    return root / mf.step_dir(step) / mf.rank_manifest_name(0)


def _entry(root: Path, step: int) -> dict[str, Any]:
    raw = json.loads(_rpath(root, step).read_bytes())
    return next(c for c in raw["chunks"] if c["fqn"] == W)


def _sections(root: Path, step: int) -> list[bytes]:
    """The stored sections of step's weight chunk (an incremental codec's delta)."""
    c = _entry(root, step)
    data = (root / mf.step_dir(step) / c["file"]).read_bytes()
    data = data[c["byte_offset"] : c["byte_offset"] + c["nbytes"]]
    out, pos = [], 0
    for size in c["params"]["sections"]:
        out.append(data[pos : pos + size])
        pos += size
    return out


def _replace_chunk(root: Path, step: int, data: bytes, params: dict[str, Any]) -> None:
    """Step's weight chunk now stored as ``data`` (appended to its own data file) with
    ``params``; the checksum matches, as a crafted checkpoint's would."""
    path = _rpath(root, step)
    raw = json.loads(path.read_bytes())
    c = next(c for c in raw["chunks"] if c["fqn"] == W)
    file = root / mf.step_dir(step) / c["file"]
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(data)
    checksum = xxhash.xxh3_64_hexdigest(data)
    c.update(byte_offset=offset, nbytes=len(data), checksum=checksum, params=params)
    path.write_text(json.dumps(raw))


def _craft(root: Path, step: int, form: str, frame: bytes) -> None:
    """Step's weight chunk carrying ``frame``, in one of these forms:

    - ``planes``: today's zstd chunk, its first byte plane the frame, the others raw;
    - ``one-frame``: a zstd chunk as written before byte planes (no ``planes`` parameter);
    - ``<codec>:<i>``: the stored delta of an incremental codec, section ``i`` replaced.
    """
    if form == "planes":
        planes = [["zstd", len(frame)], *[["raw", PLANE]] * 3]
        data, params = frame + bytes(3 * PLANE), {"level": 1, "shuffle": 4, "planes": planes}
    elif form == "one-frame":
        data, params = frame, {"level": 1, "shuffle": 4}
    else:
        sections = _sections(root, step)
        sections[int(form.split(":")[1])] = frame
        params = {**_entry(root, step)["params"], "sections": [len(s) for s in sections]}
        data = b"".join(sections)
    _replace_chunk(root, step, data, params)


def _digests(root: Path, steps: tuple[int, ...]) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for s in steps
        for p in sorted((root / mf.step_dir(s)).iterdir())
    }


def _restore(root: Path) -> tuple[int, dict[str, torch.Tensor]]:
    fresh = _state()
    with (
        pytest.warns(UserWarning, match="falling back"),
        Checkpointer(str(root), fresh, every=1, keep=0) as ck,
    ):
        got = ck.restore()
    return got, fresh["model"].state_dict()


def _where(step: int) -> str:
    return f"step {step}, rank 0, tensor '{W}', file {FILE}: cannot decode: "


# -- (a)-(c): the lie is named, whatever codec carries it -----------------------------------------
def _declares(n: int, expected: int) -> str:
    return f"holds a zstd frame that declares {n} bytes, more than the {expected} expected"


ZSTD_CASES = [
    ("planes", claims_1_tib, "zstd plane 0 " + _declares(TIB, PLANE)),
    ("planes", states_256_mib, "zstd plane 0 " + _declares(BOMB, PLANE)),
    ("planes", bomb, f"zstd plane 0 holds more than the {PLANE} bytes expected"),
    ("one-frame", claims_1_tib, "zstd data " + _declares(TIB, DECLARED)),
    ("one-frame", states_256_mib, "zstd data " + _declares(BOMB, DECLARED)),
    ("one-frame", bomb, f"zstd data holds more than the {DECLARED} bytes expected"),
]


@pytest.mark.parametrize(
    ("form", "frame", "message"), ZSTD_CASES, ids=[f"{f}-{fn.__name__}" for f, fn, _ in ZSTD_CASES]
)
def test_a_lying_zstd_chunk_is_damage_and_restore_falls_back(tmp_path, form, frame, message):
    root = tmp_path / "run"
    saved = _write(root, "zstd")
    before = _digests(root, (1,))
    _craft(root, 2, form, frame())
    with pytest.raises(CorruptCheckpointError) as e:
        load(str(root))
    assert str(e.value) == _where(2) + message
    step, got = _restore(root)
    assert step == 1
    assert all(torch.equal(got[k], v) for k, v in saved[0].items())
    assert _digests(root, (1,)) == before


# Expected sizes of the delta (2 steps of Linear(64, 64), rows 0..7 changed): 64 blocks of a
# row each, so an 8-byte changed-block map; 8 changed blocks: 8 kind bytes (q codecs) and a
# payload of 8 * 64 float32 (delta).
INCREMENTAL_CASES = [
    (codec, section, name, expected)
    for codec in ("delta", "q8", "q4", "q2")
    for section, name, expected in (
        [(0, "the changed-block map", 8), (1, "the delta payload", 2048)]
        if codec == "delta"
        else [(0, "the changed-block map", 8), (1, "block kinds", 8)]
    )
]


def _delta_chunk(codec_name: str) -> tuple[list[bytes], dict[str, Any], torch.Tensor]:
    """Sections and params of ``codec_name``'s delta of a 64x64 chunk (8 rows changed)."""
    codec = get_codec(codec_name)
    torch.manual_seed(0)
    x0 = torch.randn(64, 64)
    x1 = x0.clone()
    x1[:8] += 1.0
    _, ref = codec.encode(x0, None)
    enc, _ = codec.encode(x1, ref)
    assert enc.delta
    return [bytes(memoryview(b)) for b in enc.data], enc.params, x0


@pytest.mark.parametrize(
    ("codec", "section", "name", "expected"),
    INCREMENTAL_CASES,
    ids=[f"{c}-section-{s}" for c, s, _, _ in INCREMENTAL_CASES],
)
@pytest.mark.parametrize("lie", ["claims-1-tib", "bomb", "understated"])
def test_a_lying_section_of_an_incremental_codec_is_a_codec_error(
    codec, section, name, expected, lie
):
    sections, params, base = _delta_chunk(codec)
    frame = {"claims-1-tib": claims_1_tib, "bomb": bomb}.get(lie, lambda: understated(3))()
    sections[section] = frame
    params = {**params, "sections": [len(s) for s in sections]}
    want = {
        "claims-1-tib": f"{name} {_declares(TIB, expected)}",
        "bomb": f"{name} holds more than the {expected} bytes expected",
        "understated": f"{name} holds 3 bytes, expected {expected}",
    }[lie]
    with pytest.raises(CodecError) as e:
        get_codec(codec).decode(
            b"".join(sections), params, dtype=torch.float32, shape=(64, 64), base=base
        )
    assert str(e.value) == want


@pytest.mark.parametrize("codec", ["delta", "q8", "q4", "q2"])
def test_a_bomb_in_a_stored_delta_falls_back_to_its_base(tmp_path, codec):
    root = tmp_path / "run"
    saved = _write(root, codec)
    assert _entry(root, 2)["base_step"] == 1
    before = _digests(root, (1,))
    _craft(root, 2, f"{codec}:0", bomb())
    with pytest.raises(CorruptCheckpointError) as e:
        load(str(root))
    assert str(e.value) == _where(2) + "the changed-block map holds more than the 8 bytes expected"
    step, got = _restore(root)
    assert step == 1
    assert all(torch.equal(got[k], v) for k, v in saved[0].items())
    assert _digests(root, (1,)) == before


# -- (d): verify, end to end ----------------------------------------------------------------------
def test_verify_names_the_bomb_step_in_one_line_and_exits_1(tmp_path):
    root = tmp_path / "run"
    saved = _write(root, "zstd")
    before = _digests(root, (1,))
    _craft(root, 2, "planes", bomb())
    r = subprocess.run(
        [sys.executable, "-m", "checkflow.cli", "verify", str(root), "--all"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stdout + r.stderr and "MemoryError" not in r.stdout + r.stderr
    ok, fail = r.stdout.splitlines()
    assert ok.startswith("step 1: OK (") and ok.endswith(" KiB read and decoded)"), ok
    assert fail == f"FAIL {_where(2)}zstd plane 0 holds more than the {PLANE} bytes expected"
    assert r.stderr.splitlines() == [
        "checkflow: error: verification failed: 1 of 2 checkpoint(s) have problems; restore "
        "an older step with --step, and remove a damaged newest one before resuming"
    ]
    assert all(torch.equal(load(str(root), 1)["model"][k], v) for k, v in saved[0].items())
    assert _digests(root, (1,)) == before


# -- the memory bound, measured -------------------------------------------------------------------
PEAK_CHILD = """
import json, resource, sys
from checkflow.restore import CheckpointReader
from checkflow.storage import Storage

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # KiB on Linux

good, bad = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for root in good:  # every decode path warmed up: imports, the kernel, thread buffers
    assert CheckpointReader(Storage(root)).verify(2) == [], root
start = peak()
problems = [CheckpointReader(Storage(root)).verify(2) for root in bad]
print(json.dumps({"grew": peak() - start, "problems": problems}))
"""
PEAK_BOUND = 16 << 20
"""What verifying all the crafted steps may add to a warm reader's peak RSS: each chunk
decodes into at most 16 KiB + 1 byte with a window of at most 1 MiB (:mod:`codec.frames`);
the rest is allocator slack. Unbounded, the first bomb alone adds 256 MiB."""


def test_lying_frames_cost_a_reader_no_more_than_their_declared_size(tmp_path):
    """A child process verifies good copies of each root (warming every decode path), then
    the crafted ones; its peak RSS grows by less than ``PEAK_BOUND`` over all of them."""
    cases = [(f"zstd-{f}-{fn.__name__}", "zstd", f, fn) for f, fn, _ in ZSTD_CASES] + [
        (f"{c}-{s}-{fn.__name__}", c, f"{c}:{s}", fn)
        for c, s, _, _ in INCREMENTAL_CASES
        for fn in (bomb, states_256_mib)
    ]
    good = {c: tmp_path / f"good-{c}" for c in ("zstd", "delta", "q8", "q4", "q2")}
    for codec, root in good.items():
        _write(root, codec)
    bad = []
    for name, codec, form, frame in cases:
        shutil.copytree(good[codec], tmp_path / name)
        _craft(tmp_path / name, 2, form, frame())
        bad.append(str(tmp_path / name))
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            PEAK_CHILD,
            json.dumps([str(p) for p in good.values()]),
            json.dumps(bad),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert [len(p) for p in got["problems"]] == [1] * len(cases)
    assert all("cannot decode: " in p[0] for p in got["problems"])
    assert got["grew"] < PEAK_BOUND, got
