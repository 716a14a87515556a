"""How far the read threads run ahead of whoever takes the decoded chunks.

A chunk decoded into new memory holds it until it is taken, so only a few are read ahead;
one decoded into its live tensor holds nothing once done, so a restore queues all of them
and no read thread idles while the caller waits for the chunk in front. A failure or an
early stop cancels the chunks not yet started.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from checkflow.read.plan import ReadItem
from checkflow.read.reader import CheckpointReader
from checkflow.storage import Storage

THREADS = 2


class Recording(CheckpointReader):
    """A reader whose chunks are numbers: ``chunk`` records when each one runs and calls
    ``work(number)`` to decode it."""

    def __init__(self, root: Path, work: Any) -> None:
        super().__init__(Storage(str(root)))
        self.work = work
        self.started: list[int] = []
        self.taken = 0
        self.most_ahead = 0
        self._record = threading.Lock()

    def chunk(self, step: int, rank: int, entry: Any, into: torch.Tensor | None = None) -> Any:
        with self._record:
            self.started.append(entry)
            self.most_ahead = max(self.most_ahead, len(self.started) - self.taken)
        self.work(entry)
        return into if into is not None else torch.full((1,), entry)

    def take(self, count: int, into: list[torch.Tensor | None] | None = None) -> list[Any]:
        items = [ReadItem(0, n, (), (), ()) for n in range(count)]  # type: ignore[arg-type]
        got = []
        for out in self.decode_parts(1, items, into):
            got.append(out)
            self.taken += 1
        return got


@pytest.fixture(autouse=True)
def _two_threads(monkeypatch):
    monkeypatch.setenv("CHECKFLOW_READ_THREADS", str(THREADS))


def test_chunks_into_new_memory_are_read_at_most_threads_plus_one_ahead(tmp_path):
    reader = Recording(tmp_path, lambda n: time.sleep(0.002))
    got = reader.take(30)
    assert [int(t) for t in got] == list(range(30))
    assert reader.most_ahead <= THREADS + 1


def test_chunks_into_live_tensors_are_all_queued_so_no_thread_waits_for_the_first(tmp_path):
    """The first chunk is slow; with a window of three, the second thread would stop after
    the third chunk and wait for the caller to take the first. Here it decodes the rest."""
    rest_done = threading.Event()
    count = 12

    def work(n: int) -> None:
        if n == 0:
            assert rest_done.wait(60), "the other thread stopped while the first chunk decoded"
        elif n == count - 1:
            rest_done.set()

    reader = Recording(tmp_path, work)
    targets: list[torch.Tensor | None] = [torch.empty(1) for _ in range(count)]
    got = reader.take(count, targets)
    assert all(g is t for g, t in zip(got, targets, strict=True))


def test_a_failed_chunk_cancels_the_chunks_not_yet_started(tmp_path):
    count = 40

    def work(n: int) -> None:
        if n == 1:
            raise RuntimeError("chunk 1 is corrupt")
        if n > 1:
            time.sleep(0.2)

    reader = Recording(tmp_path, work)
    with pytest.raises(RuntimeError, match="chunk 1 is corrupt"):
        reader.take(count, [torch.empty(1) for _ in range(count)])
    # Chunks 2.. take 0.2 s each on two threads: the failure is seen long before the
    # queue drains (40 chunks would be 4 s), and what had not started never runs.
    assert len(reader.started) <= 10
