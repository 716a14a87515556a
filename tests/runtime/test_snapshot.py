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
