"""Phase 1: the optimizer pre-hook waits for the copy; unprotected tensors are copied at once."""

from __future__ import annotations

import threading

import pytest
import torch

from checkflow.codec import CodecRules
from checkflow.objects import UnstorableObjectError
from checkflow.state import FlatState, flatten
from checkflow.storage import Storage
from checkflow.write.buffers import BufferSets
from checkflow.write.commit import SingleProcessCommit
from checkflow.write.persist import PersistWorker
from checkflow.write.snapshot import Snapshotter, protected_pointers
from tests.runtime._models import small_state, train_step


def _take(snapper: Snapshotter, step: int, flat, protected):
    pool = snapper.buffers.try_acquire()
    assert pool is not None
    return snapper.take(step, flat, protected, pool)


def test_optimizer_step_waits_for_the_background_copy_of_the_weights():
    state = small_state()
    train_step(state)
    snapper = Snapshotter()
    gate = threading.Event()
    # Hold the copy thread so the copy is provably still running when the optimizer steps.
    snapper._executor.submit(gate.wait)
    weights = state["model"][0].weight.detach().clone()
    snap = _take(snapper, 1, flatten(state), protected_pointers([state["optim"]]))
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
    snap = _take(snapper, 1, flatten(state), protected_pointers([state["optim"]]))
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
    from checkflow.write.snapshot import CudaCopier

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


class _StandInCudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on CUDA, so ``take`` routes it through the copier."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_cuda_tensors_no_optimizer_guards_order_the_device_before_take_returns():
    # BatchNorm statistics change in the next forward pass, which no optimizer hook orders:
    # take() itself must make the current stream wait for their copy. Weights and optimizer
    # state are ordered later, by the optimizer pre-hook.
    fake = _FakeCuda()
    state = small_state()
    train_step(state)
    flat = flatten(state)
    protected = protected_pointers([state["optim"]])
    flat.tensors = {k: v.as_subclass(_StandInCudaTensor) for k, v in flat.tensors.items()}
    snapper = Snapshotter(cuda=fake)
    snap = _take(snapper, 1, flat, protected)
    waits = [(i, c) for i, c in enumerate(fake.calls) if c[0] == "current_waits_event"]
    assert len(waits) == 1, fake.calls  # exactly the unprotected copy's event, at take()
    records = [i for i, c in enumerate(fake.calls) if c[0] == "record"]
    assert len(records) == 2  # one copy of the unprotected tensors, one of the protected
    assert waits[0][1][1] is snap._cuda_events[0][1]
    # The unprotected copy was queued and ordered before the protected one was queued.
    assert records[0] < waits[0][0] < records[1]
    assert torch.equal(snap.tensors["model.1.running_mean"], state["model"][1].running_mean)
    snapper.close()


def test_buffer_sets_make_at_most_two_and_wait_for_a_release():
    sets = BufferSets(2)
    a, b = sets.try_acquire(), sets.try_acquire()
    assert a is not None and b is not None and a is not b
    assert sets.try_acquire() is None and not sets.has_free()
    threading.Timer(0.2, sets.release, args=(a,)).start()
    got, waited = sets.acquire()
    assert got is a and waited >= 0.15
    assert sets.made == 2


class _GatedCopy(torch.Tensor):
    """A source tensor whose copy into a host buffer waits for ``gate``: holds the copy
    thread at a known tensor, so what ``ready`` hands out before then is provable."""

    gate = threading.Event()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            cls.gate.wait()
        return super().__torch_function__(func, types, args, kwargs or {})


def _two_tensor_state() -> tuple[FlatState, set[int]]:
    first = torch.arange(1024, dtype=torch.float32)
    second = torch.full((1024,), 7.0).as_subclass(_GatedCopy)
    flat = FlatState(tensors={"first": first, "second": second}, skeleton={})
    return flat, {first.untyped_storage().data_ptr(), second.untyped_storage().data_ptr()}


def test_ready_hands_out_each_tensor_once_copied_while_later_ones_still_copy():
    # The persist thread writes the first tensors of a snapshot while the copy thread is
    # still copying later ones, instead of waiting for the whole copy.
    _GatedCopy.gate.clear()
    snapper = Snapshotter()
    flat, protected = _two_tensor_state()
    snap = _take(snapper, 1, flat, protected)
    ready = snap.ready()
    fqn, tensor = next(ready)
    assert fqn == "first" and torch.equal(tensor, torch.arange(1024, dtype=torch.float32))
    assert not snap.done()  # the copy of "second" is held at its gate
    got: list[tuple[str, torch.Tensor]] = []
    waiter = threading.Thread(target=lambda: got.extend(ready))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # "second" is not handed out before its copy
    _GatedCopy.gate.set()
    waiter.join(10)
    assert [f for f, _ in got] == ["second"] and torch.equal(got[0][1], torch.full((1024,), 7.0))
    assert snap.done() and snap.copied is not None
    snapper.close()


class _FailingCopy(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_:
            raise RuntimeError("device lost")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_ready_raises_the_copy_error_at_the_first_tensor_never_copied():
    snapper = Snapshotter()
    first = torch.ones(16)
    broken = torch.zeros(16).as_subclass(_FailingCopy)
    flat = FlatState(tensors={"first": first, "broken": broken}, skeleton={})
    protected = {t.untyped_storage().data_ptr() for t in (first, broken)}
    ready = _take(snapper, 1, flat, protected).ready()
    assert next(ready)[0] == "first"
    with pytest.raises(RuntimeError, match="device lost"):
        next(ready)
    snapper.close()


def test_a_persist_that_fails_before_writing_releases_the_buffers_only_after_the_copy(tmp_path):
    # The persist thread no longer waits for the whole copy before it starts; one that fails
    # at once must still not hand the buffer set back while the copy thread writes into it.
    _GatedCopy.gate.clear()
    snapper = Snapshotter()
    flat, protected = _two_tensor_state()
    flat.skeleton["not data"] = object()  # objects.encode refuses it: the persist fails first
    released: list[bool] = []
    worker = PersistWorker(
        Storage(str(tmp_path)),
        codecs=CodecRules("exact"),
        commit=SingleProcessCommit(),
        on_done=lambda snap: released.append(snap.done()),
    )
    future = worker.submit(_take(snapper, 1, flat, protected))
    threading.Timer(0.3, _GatedCopy.gate.set).start()
    with pytest.raises(UnstorableObjectError):
        future.result(timeout=10)
    assert released == [True]
    worker.close()
    snapper.close()
