"""A real ``Checkpointer`` tells a real coordinator each checkpoint's kind: the first of an
incremental chain is full, the next ones deltas, as their ``MANIFEST.json`` says."""

from __future__ import annotations

import torch

from checkflow import Checkpointer
from checkflow.catalog import scan
from checkflow.protocol import CheckpointList, paths
from checkflow.storage import Storage
from tests.support.coordinator import TOKEN, ThreadServer
from tests.support.net import free_port


def test_the_coordinator_shows_full_then_delta_for_an_incremental_chain(tmp_path):
    server = ThreadServer(tmp_path / "c.db", free_port())
    server.start()
    try:
        model = torch.nn.Linear(64, 64)
        with Checkpointer(
            str(tmp_path / "ckpt"),
            {"model": model},
            every=1,
            codec="delta",
            coordinator=server.url,
            job="kinds",
            token=TOKEN,
        ) as ckpt:
            for _ in range(3):
                with torch.no_grad():
                    model.weight[0, 0] += 1.0  # a small change: the next one is a delta
                ckpt.step()
            ckpt.wait()
        listed = CheckpointList.model_validate(
            server.get(paths.path(paths.CHECKPOINTS, job="kinds"))
        )
    finally:
        server.stop()
    on_storage = {s: m.kind for s, m in scan(Storage(str(tmp_path / "ckpt"))).committed.items()}
    at_coordinator = {c.step: c.kind for c in listed.checkpoints}
    assert at_coordinator == on_storage == {1: "full", 2: "delta", 3: "delta"}
