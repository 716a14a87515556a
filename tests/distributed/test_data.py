"""checkflow.data: the saved position is global, so a resume on another DP size neither
skips nor repeats a sample."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from checkflow import Checkpointer
from checkflow.data import ResumableSampler

N = 60


def _take(samplers: list[ResumableSampler], rounds: int | None) -> list[int]:
    """Every rank draws ``rounds`` samples in lockstep (all that is left when None)."""
    iters = [iter(s) for s in samplers]
    seen = []
    for _ in range(rounds if rounds is not None else len(samplers[0])):
        seen.extend(next(it) for it in iters)
    return seen


def _ranks(world: int, **kw: object) -> list[ResumableSampler]:
    return [ResumableSampler(N, seed=7, rank=r, world_size=world, **kw) for r in range(world)]


@pytest.mark.parametrize(
    ("before", "after", "rounds"), [(2, 3, 6), (4, 2, 6), (2, 1, 6), (3, 4, 8), (4, 3, 3)]
)
def test_resume_on_another_world_size_sees_each_sample_of_the_epoch_exactly_once(
    before, after, rounds
):
    uninterrupted = _take(_ranks(before), None)
    assert Counter(uninterrupted) == Counter(range(N))

    first = _ranks(before)
    seen = _take(first, rounds)  # rounds * before samples consumed by the whole job
    state = first[0].state_dict()
    assert state["consumed"] == rounds * before
    resumed = _ranks(after)
    for s in resumed:
        s.load_state_dict(state)
    seen += _take(resumed, None)
    assert Counter(seen) == Counter(uninterrupted)


def test_padding_covers_every_sample_when_the_rest_does_not_divide():
    first = _ranks(2)
    seen = _take(first, 5)  # 10 consumed, 50 left over 3 ranks: one padded sample
    resumed = _ranks(3)
    for s in resumed:
        s.load_state_dict(first[1].state_dict())
    rest = _take(resumed, None)
    assert set(seen) | set(rest) == set(range(N))
    assert not set(seen) & set(rest)
    assert len(rest) == 51


def test_epochs_have_different_orders_and_the_same_order_on_every_run():
    a, b = ResumableSampler(N, seed=1, rank=0, world_size=1), ResumableSampler(N, seed=1)
    assert list(a) == list(b)
    a.set_epoch(1)
    assert list(a) != list(b)
    with pytest.raises(ValueError, match="seed"):
        ResumableSampler(N, seed=2).load_state_dict(b.state_dict())


def test_sampler_position_round_trips_through_a_checkpoint(tmp_path):
    data = torch.arange(N).float().unsqueeze(1)
    sampler = ResumableSampler(N, seed=3, rank=0, world_size=2)
    loader = iter(DataLoader(data, batch_size=4, sampler=sampler))
    model = torch.nn.Linear(1, 1)
    with Checkpointer(str(tmp_path), {"model": model, "data": sampler}, every=1000) as ckpt:
        seen = [int(v) for _ in range(3) for v in next(loader).flatten()]
        ckpt.save().result()
    assert sampler.consumed == 3 * 4 * 2  # 3 batches of 4 on each of 2 ranks

    resumed = ResumableSampler(N, seed=3, rank=0, world_size=4)
    with Checkpointer(str(tmp_path), {"model": model, "data": resumed}, every=1000) as ckpt:
        ckpt.restore()
    assert resumed.consumed == 24
    order = torch.randperm(N, generator=torch.Generator().manual_seed(3 * 1_000_003)).tolist()
    assert seen == order[0:24:2][:12]
    assert list(resumed) == order[24::4]
