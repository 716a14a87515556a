"""Checkpoints move between XLA and CPU bitwise, and a q8 incremental chain works on XLA.

These run in the test process on one XLA:CPU device (``PJRT_DEVICE=CPU``, set by the
conftest before torch_xla is imported).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from checkflow import Checkpointer, load
from checkflow.read.reader import CheckpointReader
from checkflow.storage import Storage
from tests.runtime._train import assert_bitwise_equal


def _model(device: Any, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, device: Any) -> None:
    import torch_xla

    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 16, generator=g).to(device)
        nn.functional.mse_loss(model(x), torch.zeros(32, 8, device=device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "xla":
            torch_xla.sync()


def _on_cpu(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    def cpu(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.cpu().clone()  # a CPU tensor's .cpu() is itself: training would move it
        return {k: cpu(x) for k, x in v.items()} if isinstance(v, dict) else v

    return {"model": cpu(dict(model.state_dict())), "optim": cpu(opt.state_dict())}


def _save(root: Path, model: nn.Module, opt: torch.optim.Optimizer, **kw: Any) -> None:
    with Checkpointer(str(root), {"model": model, "optim": opt}, every=1000, rng=False, **kw) as c:
        c.save().result(timeout=300)


def _restore(root: Path, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    with Checkpointer(str(root), {"model": model, "optim": opt}, every=1000, rng=False) as c:
        return c.restore()


def test_a_checkpoint_written_on_xla_restores_on_cpu_bitwise(tmp_path: Path) -> None:
    import torch_xla

    xla = torch_xla.device()
    model, opt = _model(xla)
    _train(model, opt, 3, xla)
    _save(tmp_path, model, opt)

    cpu_model, cpu_opt = _model(torch.device("cpu"), seed=1)  # other weights until restored
    _train(cpu_model, cpu_opt, 1, torch.device("cpu"))  # optimizer state exists, differs
    _restore(tmp_path, cpu_model, cpu_opt)
    assert_bitwise_equal(_on_cpu(model, opt), _on_cpu(cpu_model, cpu_opt))
    assert cpu_model[0].weight.device.type == "cpu"


def test_a_checkpoint_written_on_cpu_restores_onto_xla_bitwise(tmp_path: Path) -> None:
    import torch_xla

    cpu = torch.device("cpu")
    model, opt = _model(cpu)
    _train(model, opt, 3, cpu)
    _save(tmp_path, model, opt)

    xla = torch_xla.device()
    xla_model, xla_opt = _model(xla, seed=1)
    _restore(tmp_path, xla_model, xla_opt)
    assert xla_model[0].weight.device.type == "xla"
    assert_bitwise_equal(_on_cpu(model, opt), _on_cpu(xla_model, xla_opt))
    # And training goes on from there on the XLA device.
    _train(xla_model, xla_opt, 1, xla)


def test_a_restore_into_live_xla_optimizer_state_refills_it_in_place_bitwise(
    tmp_path: Path,
) -> None:
    """With optimizer state already on the device, the restore copies into those tensors
    (no new device buffers) and training goes on exactly as from a fresh optimizer."""
    import torch_xla

    xla = torch_xla.device()
    model, opt = _model(xla)
    _train(model, opt, 3, xla)
    _save(tmp_path, model, opt)
    saved = _on_cpu(model, opt)
    _train(model, opt, 2, xla)  # live state moves on: the restore must bring it back
    live = [id(t) for s in opt.state.values() for t in s.values() if t.device.type == "xla"]
    assert live, "AdamW keeps exp_avg / exp_avg_sq on the device"

    _restore(tmp_path, model, opt)
    assert_bitwise_equal(saved, _on_cpu(model, opt))
    after = [id(t) for s in opt.state.values() for t in s.values() if t.device.type == "xla"]
    assert after == live  # the same device tensors, refilled

    fresh_model, fresh_opt = _model(xla, seed=1)  # no optimizer state: .to() places it
    _restore(tmp_path, fresh_model, fresh_opt)
    _train(model, opt, 1, xla)
    _train(fresh_model, fresh_opt, 1, xla)
    assert_bitwise_equal(_on_cpu(fresh_model, fresh_opt), _on_cpu(model, opt))


def test_q8_incremental_chain_on_xla_restores_its_reconstruction_and_stays_close(
    tmp_path: Path,
) -> None:
    import torch_xla

    xla = torch_xla.device()
    model, opt = _model(xla)
    state = {"model": model, "optim": opt}
    live: dict[int, dict[str, Any]] = {}
    with Checkpointer(str(tmp_path), state, every=1, codec="q8", full_every=10, keep=0) as c:
        for step in range(1, 6):
            _train(model, opt, 1, xla)
            c.step()
            live[step] = _on_cpu(model, opt)
        c.wait()

    reader = CheckpointReader(Storage(str(tmp_path)))
    deltas = [
        s
        for s in live
        if any(ch.base_step is not None for ch in reader.rank_manifests(s)[0].chunks)
    ]
    assert deltas, "no step of the chain was stored as a delta"
    step = deltas[-1]

    restored_model, restored_opt = _model(xla, seed=1)
    with Checkpointer(str(tmp_path), {"model": restored_model, "optim": restored_opt}) as c:
        assert c.restore(step) == step
    on_xla = _on_cpu(restored_model, restored_opt)
    on_cpu = load(str(tmp_path), step=step)  # the same chain decoded on the CPU
    assert_bitwise_equal(dict(on_cpu["model"]), on_xla["model"], "model")
    for name, w in live[step]["model"].items():
        err = (on_xla["model"][name] - w).abs().max().item()
        assert err <= w.abs().max().item() / 100, f"{name}: q8 error {err}"


def _wide(device: Any, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Six 768 x 768 layers: every weight and moment (2.25 MiB) is a chunk-sized read."""
    torch.manual_seed(seed)
    model = nn.Sequential(*(nn.Linear(768, 768) for _ in range(6))).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train_wide(model: nn.Module, opt: torch.optim.Optimizer, steps: int, device: Any) -> None:
    import torch_xla

    for step in range(steps):
        x = torch.randn(8, 768, generator=torch.Generator().manual_seed(step)).to(device)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch_xla.sync()


def test_a_restore_onto_xla_lands_each_tensor_in_place_through_a_few_reused_buffers(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Each tensor is copied into the live parameter or optimizer state as soon as it is
    read, so the host holds a few chunks at a time, read past the page cache into buffers
    that are reused once torch_xla's transfer out of them is done."""
    import torch_xla

    from checkflow.read import reader as reader_module

    made: list[Any] = []

    class Recorded(reader_module.ReadBuffers):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    monkeypatch.setattr(reader_module, "ReadBuffers", Recorded)
    xla = torch_xla.device()
    model, opt = _wide(xla)
    _train_wide(model, opt, 2, xla)
    _save(tmp_path, model, opt)
    saved = _on_cpu(model, opt)
    _train_wide(model, opt, 1, xla)  # the live state moves on
    live = [id(t) for t in model.parameters()]
    live += [id(t) for s in opt.state.values() for t in s.values() if t.device.type == "xla"]

    _restore(tmp_path, model, opt)
    assert_bitwise_equal(saved, _on_cpu(model, opt))
    after = [id(t) for t in model.parameters()]
    after += [id(t) for s in opt.state.values() for t in s.values() if t.device.type == "xla"]
    assert after == live  # the same tensors, refilled
    (buffers,) = made
    assert 1 <= buffers.allocated <= 8, buffers.allocated  # 18 chunks of 2.25 MiB were read
    _train_wide(model, opt, 1, xla)  # and training goes on


def test_a_failed_restore_that_already_refilled_xla_tensors_says_so(tmp_path: Path) -> None:
    """A chunk found corrupt after others were copied into the live tensors leaves them
    mixed; with no older checkpoint to fall back to, the restore fails instead of
    training on from step 0 with part of a checkpoint in the model."""
    import pytest
    import torch_xla

    from checkflow import manifest as mf
    from checkflow.catalog import committed_steps

    xla = torch_xla.device()
    model, opt = _wide(xla)
    _train_wide(model, opt, 1, xla)
    _save(tmp_path, model, opt)
    (step,) = committed_steps(Storage(str(tmp_path)))
    chunks = CheckpointReader(Storage(str(tmp_path))).rank_manifests(step)[0].chunks
    last = [c for c in chunks if c.fqn.startswith("optim.")][-1]  # read after the model
    path = tmp_path / mf.step_dir(step) / last.file
    data = bytearray(path.read_bytes())
    data[last.byte_offset + 100] ^= 0xFF
    path.write_bytes(bytes(data))

    with pytest.raises(RuntimeError, match="create them anew"):
        _restore(tmp_path, model, opt)
