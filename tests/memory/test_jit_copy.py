"""Just-in-time checkpoints (``checkflow.memory.jit``) in one process: when the state is
whole, the copy of a failing rank, the replica rule of the RAM copies, and what ``jit=True``
refuses. The multi-process recovery is in ``tests/launch/test_jit.py``."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from checkflow import Checkpointer
from checkflow.memory.copies import RamCopies
from checkflow.memory.jit import JitGuard, Marked, check_replicated
from checkflow.memory.tier import RamTier
from checkflow.objects import TensorRef
from checkflow.parallel.sharding import LiveState
from checkflow.write.snapshot import Snapshot


def nothing() -> dict[str, object]:
    return {}


def test_freeze_waits_for_an_update_in_progress_and_returns_the_step_it_ends_in() -> None:
    guard = JitGuard()
    guard.mark(7, nothing)
    guard.before_update()  # the training thread is inside optimizer.step()
    frozen: list[Marked | None] = []
    freezer = threading.Thread(target=lambda: frozen.append(guard.freeze(timeout_s=10)))
    freezer.start()
    time.sleep(0.2)
    assert not frozen, "the weights are changing: no copy yet"
    marked_8 = threading.Thread(target=guard.mark, args=(8, nothing), daemon=True)
    marked_8.start()  # ckpt.step() ends the update; the training thread is then held
    freezer.join(10)
    assert frozen and frozen[0] is not None and frozen[0].step == 8
    time.sleep(0.1)
    assert marked_8.is_alive(), "the training thread must not go on while the copy is taken"


def test_the_training_thread_failing_inside_an_update_leaves_no_whole_state() -> None:
    guard = JitGuard()
    guard.mark(7, nothing)
    guard.before_update()
    assert guard.freeze(timeout_s=5) is None


def test_freeze_outside_an_update_returns_the_last_marked_step_at_once() -> None:
    guard = JitGuard()
    guard.mark(3, nothing)
    t0 = time.perf_counter()
    marked = guard.freeze(timeout_s=5)
    assert marked is not None and marked.step == 3 and time.perf_counter() - t0 < 1


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(model: nn.Module, opt: torch.optim.Optimizer, ckpt: Checkpointer, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(3, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ckpt.step()


def test_a_failure_in_training_writes_the_current_step_to_the_ram_tier(tmp_path: Path) -> None:
    model, opt = make_model()
    ram = tmp_path / "ram"
    state = {"model": model, "optim": opt}
    ckpt = Checkpointer(str(tmp_path / "ckpt"), state, every=5, ram_dir=str(ram), jit=True)
    with pytest.raises(RuntimeError, match="a peer died"), ckpt:  # noqa: PT012
        train(model, opt, ckpt, 7)
        model(torch.randn(3, 4)).square().mean().backward()  # step 8's gradients
        raise RuntimeError("a peer died")  # as a failed all-reduce would
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    copies = RamCopies(str(ram), rank=0, world_size=1)
    assert copies.steps() == {5, 7}, "the checkpoint of step 5 and the JIT copy of step 7"
    restored, opt2 = make_model()
    with Checkpointer(
        str(tmp_path / "ckpt"), {"model": restored, "optim": opt2}, every=5, ram_dir=str(ram)
    ) as again:
        assert again.restore() == 7 and again.restored_from == "ram"
    for k, v in restored.state_dict().items():
        assert torch.equal(v, weights[k]), k


def write_ram_step(ram: Path, rank: int, step: int, *, replica: bool) -> None:
    tier = RamTier(
        str(ram), rank=rank, world_size=2, keep=2, release=lambda _s: None, replica=replica
    )
    skeleton = {"model": {"w": TensorRef("model.w")}, "n": step}
    snapshot = Snapshot(step=step, tensors={"model.w": torch.arange(4.0)}, skeleton=skeleton)
    tier.submit(snapshot, {}, None).result(timeout=30)
    tier.close()


def test_a_rank_reads_another_ranks_replica_copy_of_a_step_it_lacks(tmp_path: Path) -> None:
    write_ram_step(tmp_path, 0, 13, replica=True)
    write_ram_step(tmp_path, 1, 10, replica=True)
    copies = RamCopies(str(tmp_path), rank=1, world_size=2, replicas=True)
    assert copies.steps() == {10, 13}
    read = copies.read(13, LiveState(), trust=False)
    assert read["n"] == 13 and torch.equal(read["model"]["w"], torch.arange(4.0))
    assert RamCopies(str(tmp_path), rank=1, world_size=2).steps() == {10}, (
        "a job that did not declare jit=True never reads another rank's copy"
    )


def test_a_copy_that_does_not_say_replica_never_stands_for_another_rank(tmp_path: Path) -> None:
    write_ram_step(tmp_path, 0, 13, replica=False)
    assert RamCopies(str(tmp_path), rank=1, world_size=2, replicas=True).steps() == set()


def test_jit_is_refused_without_an_optimizer() -> None:
    with pytest.raises(ValueError, match="needs the optimizer"):
        check_replicated({"model": nn.Linear(2, 2)}, optimizers=0)


def test_jit_is_refused_for_sharded_state(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Linear(4, 4)
        model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
        with pytest.raises(ValueError, match="model.weight is sharded"):
            check_replicated({"model": model}, optimizers=1)
    finally:
        dist.destroy_process_group()


def test_an_uncaught_error_without_with_still_writes_the_current_step(tmp_path: Path) -> None:
    model, opt = make_model()
    ram = tmp_path / "ram"
    state = {"model": model, "optim": opt}
    ckpt = Checkpointer(str(tmp_path / "ckpt"), state, every=5, ram_dir=str(ram), jit=True)
    ckpt.open()
    try:
        train(model, opt, ckpt, 6)
        error = RuntimeError("a peer died")
        sys.excepthook(RuntimeError, error, None)  # what the interpreter calls at the top
    finally:
        ckpt.close()
    assert RamCopies(str(ram), rank=0, world_size=1).steps() == {5, 6}
