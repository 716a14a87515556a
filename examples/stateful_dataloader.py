"""torchdata's StatefulDataLoader, worker processes included, checkpointed with checkflow.

    python examples/stateful_dataloader.py [--dir PATH] [--workers 2]

A ``StatefulDataLoader`` is a state object like a module: put it in the Checkpointer's
state and its position (the sampler's order and how far it got, each worker's place, the
prefetched batches to hand out again) is saved with every checkpoint and restored by
``ckpt.restore()``. The dataset here draws a random augmentation in the worker processes
from its own generator (a ``state_dict`` of the dataset, which torchdata saves per
worker), so the batches are equal only if the workers resume exactly where they were.

The script checkpoints after 5 batches of the second epoch, reads on to the end of the
third epoch, then builds a new loader and Checkpointer, restores, and checks that the
batches it gets are bitwise the ones read after the checkpoint (exit 1 if not).

The loader's state is per rank: with several data-parallel ranks each rank stores its
own. On another data-parallel size, see the README ("torchdata StatefulDataLoader").
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from checkflow import Checkpointer


class Augmented(Dataset):
    """Sample ``i`` with noise from the dataset's own generator, in the worker loading it.

    The generator is the worker's state: torchdata saves a dataset's ``state_dict()`` in
    each worker process with the loader's state and loads it back into the new workers.
    (Noise from the global torch RNG of a worker is not saved: torchdata seeds the
    workers anew on a restore.)
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.generator = torch.Generator().manual_seed(0)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.rand(3, generator=self.generator)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


def _seed_worker(worker_id: int) -> None:
    """Each worker draws its own noise."""
    info = torch.utils.data.get_worker_info()
    assert info is not None
    info.dataset.generator.manual_seed(1000 + worker_id)


def make_loader(workers: int) -> StatefulDataLoader:
    return StatefulDataLoader(
        Augmented(40), batch_size=4, shuffle=True, num_workers=workers,
        worker_init_fn=_seed_worker,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip


def batches(stream: Iterator[Any], n: int) -> list[tuple[list[int], bytes]]:
    """The next ``n`` batches as (indices, noise bytes)."""
    return [(idx.tolist(), noise.numpy().tobytes()) for idx, noise in islice(stream, n)]


def epochs(loader: StatefulDataLoader) -> Iterator[Any]:
    """The loader's batches, epoch after epoch (each epoch is a new ``iter(loader)``)."""
    while True:
        yield from loader


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one)")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    uri = args.dir or tempfile.mkdtemp(prefix="checkflow-loader-")

    loader = make_loader(args.workers)
    stream = epochs(loader)
    batches(stream, 15)  # one epoch (10 batches) and the first 5 of the second
    with Checkpointer(uri, state={"data": loader}, every=1_000_000, rng=False) as ckpt:
        step = ckpt.save().result()
    expected = batches(stream, 15)  # the rest of epoch 2, then epoch 3

    again = make_loader(args.workers)
    with Checkpointer(uri, state={"data": again}, every=1_000_000, rng=False) as ckpt:
        restored = ckpt.restore()
    got = batches(epochs(again), 15)
    same = got == expected
    print(
        f"checkpoint {restored} (saved step {step}) in {uri}: {len(got)} batches after the "
        f"restore, {args.workers} workers: {'bitwise equal' if same else 'DIFFERENT'}"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
