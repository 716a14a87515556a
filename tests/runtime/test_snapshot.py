"""Phase 1: the optimizer pre-hook waits for the copy; unprotected tensors are copied at once."""

from __future__ import annotations

import threading

import torch

from checkflow.snapshot import Snapshotter, protected_pointers
from checkflow.state import flatten
from tests.runtime._models import small_state, train_step


def test_optimizer_step_waits_for_the_background_copy_of_the_weights():
    state = small_state()
    train_step(state)
    snapper = Snapshotter()
    gate = threading.Event()
    # Hold the copy thread so the copy is provably still running when the optimizer steps.
    snapper._executor.submit(gate.wait)
    weights = state["model"][0].weight.detach().clone()
    snap = snapper.take(1, flatten(state), protected_pointers([state["optim"]]))
    assert not snap.done()
    threading.Timer(0.2, gate.set).start()
    waited = snap.block_optimizer()  # what the pre-hook does
    assert waited >= 0.15
    train_step(state)  # now the weights change; the snapshot must hold the old ones
    snap.wait()
    assert torch.equal(snap.tensors["model.0.weight"], weights)
    assert not torch.equal(state["model"][0].weight, weights)
    snapper.close()


def test_module_buffers_are_copied_before_take_returns():
    state = small_state()
    train_step(state)
    snapper = Snapshotter()
    gate = threading.Event()
    snapper._executor.submit(gate.wait)
    mean = state["model"][1].running_mean.clone()
    snap = snapper.take(1, flatten(state), protected_pointers([state["optim"]]))
    # The next forward pass changes BatchNorm statistics in place, before any optimizer
    # step: the snapshot already holds its own copy.
    state["model"](torch.randn(8, 16))
    assert torch.equal(snap.tensors["model.1.running_mean"], mean)
    gate.set()
    snapper.close()


class _FakeCuda:
    """Records what the CUDA path asks of torch.cuda, in order (CPU-only unit test)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        fake = self

        class Stream:
            def __init__(self, device: int) -> None:
                self.device = device
                fake.calls.append(("new_stream", device))

            def wait_stream(self, other: object) -> None:
                fake.calls.append(("side_waits_for", other))

            def wait_event(self, event: object) -> None:
                fake.calls.append(("current_waits_event", event))

        class Event:
            def record(self, stream: object) -> None:
                fake.calls.append(("record", stream))

            def synchronize(self) -> None:
                fake.calls.append(("host_sync",))

            def query(self) -> bool:
                return True

        self.Stream, self.Event = Stream, Event
        self.current = Stream(-1)
        self.calls.clear()

    def current_stream(self, device: int | None = None):
        return self.current

    def stream(self, s):
        import contextlib

        fake = self

        @contextlib.contextmanager
        def ctx():
            fake.calls.append(("enter", s))
            yield
            fake.calls.append(("exit", s))

        return ctx()


def test_cuda_copies_run_on_a_side_stream_after_queued_work_and_order_the_next_step():
    from checkflow.snapshot import CudaCopier

    fake = _FakeCuda()
    copier = CudaCopier(cuda=fake)
    src, dst = torch.arange(6.0), torch.zeros(6)
    event = copier.copy(0, [(dst, src)])
    side = copier._streams[0]
    assert torch.equal(dst, src)
    names = [c[0] for c in fake.calls]
    # One side stream per device, made once; it waits for the work already queued on the
    # current stream (the optimizer step), copies inside it, then records the end event.
    assert names == ["new_stream", "side_waits_for", "enter", "record", "exit"]
    assert fake.calls[1][1] is fake.current and fake.calls[3][1] is side
    copier.copy(0, [(dst, src)])
    assert [c[0] for c in fake.calls].count("new_stream") == 1
    fake.calls.clear()
    # The optimizer pre-hook orders the device on the event: no host synchronization.
    copier.order_after(0, event)
    assert fake.calls == [("current_waits_event", event)]
