"""Two real XLA:CPU processes agree on the step to restore (``RestoreAgreement`` in the
job's c10d store): rank 1's part of the newest checkpoint is damaged, rank 0 could read
it, and both restore the older one, bitwise.

Each process has its own XLA:CPU client and device (data parallel): torch_xla 2.9's CPU
runtime cannot span processes (``test_spmd_two_processes``), so this is the multi-process
XLA job that can run here. Replicated tensors are written once, by writers balanced over
the two ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from checkflow import manifest as mf
from checkflow.restore import CheckpointReader
from checkflow.storage import Storage
from tests.distributed._launch import job_store

WORKER = Path(__file__).with_name("_xla_two_ranks.py")
ROOT = Path(__file__).resolve().parents[2]


def _run(phase: str, tmp_path: Path) -> list[dict]:
    store = job_store()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PJRT_DEVICE": "CPU",
            "CPU_NUM_DEVICES": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
        }
        cmd = [sys.executable, str(WORKER), phase, "--dir", str(tmp_path / "ckpt")]
        cmd += ["--out", str(tmp_path / "state-at-2.pt")]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        procs.append(subprocess.Popen(cmd, env=env, **pipes))
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=400)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def _damage_rank_objects(root: Path, step: int, rank: int) -> None:
    """Flip one byte of ``rank``'s objects (its skeleton) in ``step``: only that rank reads them."""
    rm = CheckpointReader(Storage(str(root))).rank_manifest(step, rank)
    entry = next(o for o in rm.objects if o.fqn == "skeleton")
    path = root / mf.step_dir(step) / entry.file
    data = bytearray(path.read_bytes())
    data[entry.byte_offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_two_xla_processes_agree_on_the_newest_step_both_read_and_restore_it_bitwise(
    tmp_path: Path,
) -> None:
    _run("save", tmp_path)
    root = tmp_path / "ckpt"
    reader = CheckpointReader(Storage(str(root)))
    assert reader.manifest(4).world_size == 2
    written = {r: {c.fqn for c in reader.rank_manifest(4, r).chunks} for r in (0, 1)}
    assert written[0] and written[1], f"one rank wrote every tensor: {written}"
    assert not written[0] & written[1], "a replicated tensor was written twice"
    _damage_rank_objects(root, 4, rank=1)

    reports = _run("restore", tmp_path)
    assert [r["restored"] for r in reports] == [2, 2]
    assert all(r["equal"] for r in reports), reports
    assert all(r["device"].startswith("xla") for r in reports)
