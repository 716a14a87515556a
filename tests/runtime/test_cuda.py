"""checkflow on a real GPU: the bytes of the CUDA snapshot path and an exact resume on CUDA.

``test_snapshot.py`` checks, with a stand-in for ``torch.cuda``, the order in which the CUDA
path queues its copies and events; these check what lands on storage, on a real device.
They are skipped where no CUDA device is (CI has none) and run on a lent GPU::

    python -m pytest -p no:cacheprovider tests/runtime/test_cuda.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from checkflow import Checkpointer
from tests.runtime._train import assert_bitwise_equal, load_final, run_train, run_until_killed

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.slow,
]


def _mlp(seed: int, width: int = 4096, layers: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).cuda()


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(256, 4096, device="cuda")
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _on_host(sd: dict) -> dict:
    """A deep copy of a state dict with every tensor moved to the host."""
    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().to("cpu", copy=True)
        elif isinstance(v, dict):
            out[k] = _on_host(v)
        elif isinstance(v, list):
            out[k] = [_on_host(x) if isinstance(x, dict) else x for x in v]
        else:
            out[k] = v
    return out


def test_snapshot_keeps_its_steps_weights_while_the_next_steps_run_on_the_gpu(tmp_path):
    # 512 MiB of weights and 1 GiB of AdamW moments: the device-to-host copy on the side
    # stream is still running when the next steps are queued, so a missing event wait
    # would let opt.step() change the weights under the copy.
    model = _mlp(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    with Checkpointer(str(tmp_path), {"model": model, "optim": opt}, every=10**6, rng=False) as c:
        c.step()
        torch.cuda.synchronize()
        expected = {"model": _on_host(model.state_dict()), "optim": _on_host(opt.state_dict())}
        future = c.save()
        for _ in range(3):
            _train_step(model, opt)
        assert future.result(timeout=300) == 1
    assert not torch.equal(model[0].weight.cpu(), expected["model"]["0.weight"]), "no step ran"

    fresh = _mlp(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with Checkpointer(str(tmp_path), {"model": fresh, "optim": fresh_opt}, rng=False) as c:
        assert c.restore() == 1
    assert all(p.is_cuda for p in fresh.parameters()), "restore moved the weights off the GPU"
    got = {"model": _on_host(fresh.state_dict()), "optim": _on_host(fresh_opt.state_dict())}
    assert_bitwise_equal(expected, got)


@pytest.fixture(scope="module")
def cuda_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("cuda-ref")
    args = ("--dir", str(d / "ckpt"), "--steps", "60", "--every", "5", "--device", "cuda")
    run_train(*args, "--out", str(d / "final.pt"))
    return load_final(d / "final.pt")


@pytest.mark.parametrize("kill_at", [13, 37])
def test_sigkill_and_resume_on_the_gpu_is_bitwise_equal_to_an_uninterrupted_run(
    tmp_path, cuda_reference, kill_at
):
    # Dropout and the input noise draw from the CUDA generator: the resume is equal only if
    # its state comes back too.
    args = ("--dir", str(tmp_path / "ckpt"), "--steps", "60", "--every", "5", "--device", "cuda")
    killed = run_until_killed(*args, kill_after_step=kill_at)
    out = run_train(*args, "--out", str(tmp_path / "final.pt"))
    start = int(out.splitlines()[0].split()[-1])
    assert 0 < start <= killed, out.splitlines()[0]
    resumed = load_final(tmp_path / "final.pt")
    assert resumed["model"]["0.weight"].is_cuda
    assert_bitwise_equal(cuda_reference, resumed)
