"""One rank of a distributed test job (run by ``_launch.run_ranks``, torchrun's environment).

``argv[1]`` is a JSON config: ``scenario`` (train | restore | data), ``kind`` (ddp | fsdp |
pipe | single), ``uri``, and the scenario's options. Results go to ``out`` (rank 0 writes
the full, gathered state) and as JSON lines on stdout.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

from checkflow import Checkpointer

IN, HIDDEN, MID, OUT = 8, 18, 10, 4  # 18 and 10 rows shard unevenly over 3, 4 and 8 ranks


def build_model() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank and every run
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.ReLU(),
        nn.Dropout(0.1),  # draws from the per-rank RNG: a resume must restore it exactly
        nn.Linear(HIDDEN, MID),
        nn.ReLU(),
        nn.Linear(MID, OUT),
    )


def wrap(model: nn.Module, kind: str, world: int) -> nn.Module:
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if kind == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, IN, generator=g), torch.randn(16, OUT, generator=g)


def full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    if isinstance(t, dict):
        return {k: full(v) for k, v in t.items()}
    if isinstance(t, list):
        return [full(v) for v in t]
    return t


def unwrap(model: nn.Module) -> nn.Module:
    # DDP's own state_dict prefixes every name with "module."; checkpoint the inner model
    # so that the names match an FSDP2 or single-process model of the same architecture.
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def dump(model: nn.Module, opt: torch.optim.Optimizer | None, out: str | None, rank: int) -> None:
    state = {"model": full(dict(unwrap(model).state_dict()))}
    if opt is not None:
        state["optim"] = full(opt.state_dict()["state"])
    if out and rank == 0:
        torch.save(state, out)


def train(cfg: dict[str, Any], rank: int, world: int) -> None:
    torch.manual_seed(100 + rank)  # per-rank RNG (dropout masks differ by rank)
    model = wrap(build_model(), cfg["kind"], world)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    every = cfg.get("every", 2)
    kill = cfg.get("kill") or {}
    steps_taken = []
    state = {"model": unwrap(model), "optim": opt}
    with Checkpointer(cfg["uri"], state, every=every, keep=0) as ckpt:
        start = ckpt.restore(cfg.get("restore_step"))
        print(json.dumps({"restored": start}), flush=True)
        for step in range(start, cfg["steps"]):
            if cfg.get("slow_rank") == rank:
                time.sleep(0.02)  # this rank's own timing would pick another interval
            # data_shift: other batches from the same step on (a rollback's new timeline).
            x, y = batch(step + cfg.get("data_shift", 0), rank)
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            future = ckpt.step()
            if future is not None:
                steps_taken.append(ckpt.current_step)
                # Waiting makes the committed steps predictable; not at the step a rank
                # dies at, so that the kill lands inside that step's persist.
                if cfg.get("wait") and ckpt.current_step != kill.get("after_step"):
                    future.result()
            if kill.get("rank") == rank and ckpt.current_step == kill["after_step"]:
                time.sleep(kill.get("delay", 0.0))
                os.kill(os.getpid(), signal.SIGKILL)
        stats = ckpt.stats
    print(json.dumps({"checkpoints": steps_taken, "skipped": stats.skipped}), flush=True)
    dump(model, opt, cfg.get("out"), rank)


def restore(cfg: dict[str, Any], rank: int, world: int) -> None:
    model = wrap(build_model(), cfg["kind"], world)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"model": unwrap(model), "optim": opt}
    with Checkpointer(cfg["uri"], state, every=1000) as ckpt:
        step = ckpt.restore(cfg.get("step"))
    if cfg.get("resave_uri"):
        with Checkpointer(cfg["resave_uri"], state, every=1000) as again:
            again.save().result()
    if cfg["kind"] == "fsdp":
        from torch.distributed.tensor import DTensor

        shard = next(iter(model.parameters()))
        assert isinstance(shard, DTensor)
        print(json.dumps({"local_rows": shard.to_local().shape[0]}), flush=True)
    elif cfg["kind"] == "single":
        print(json.dumps({"local_rows": next(iter(model.parameters())).shape[0]}), flush=True)
    print(json.dumps({"restored": step}), flush=True)
    dump(model, opt, cfg.get("out"), rank)


PIPE_WIDTHS = (IN, 12, 12, 12, OUT)  # 4 layers: 1, 2 or 4 stages


class Stage(nn.Module):
    """Layers ``first..last-1`` of a 4-layer MLP, under their global names ``layers.i``."""

    def __init__(self, first: int, last: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # every layer gets the same weights whatever the split
        layers = nn.ModuleDict(
            {str(i): nn.Linear(PIPE_WIDTHS[i], PIPE_WIDTHS[i + 1]) for i in range(4)}
        )
        for i in range(4):
            if not first <= i < last:
                del layers[str(i)]
        self.layers = layers
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.first, self.last):
            x = self.layers[str(i)](x)
            if i < 3:
                x = torch.tanh(x)
        return x


def pipeline_step(stage: Stage, step: int, rank: int, world: int) -> None:
    """One training step of a hand-built pipeline: activations forward, gradients back."""
    x, y = batch(step, 0)
    if rank > 0:
        x = torch.empty(16, PIPE_WIDTHS[stage.first])
        dist.recv(x, rank - 1)
        x.requires_grad_(True)
    out = stage(x)
    if rank < world - 1:
        dist.send(out.detach(), rank + 1)
        grad = torch.empty_like(out)
        dist.recv(grad, rank + 1)
        out.backward(grad)
    else:
        y = y[:, : PIPE_WIDTHS[-1]]
        (out - y).pow(2).mean().backward()
    if rank > 0:
        dist.send(x.grad, rank - 1)


def train_pipeline(cfg: dict[str, Any], rank: int, world: int) -> None:
    from checkflow.distributed import ModelState

    per = 4 // world
    stage = Stage(rank * per, (rank + 1) * per)
    opt = torch.optim.Adam(stage.parameters(), lr=0.01)
    state = ModelState(stage, opt)
    kill = cfg.get("kill") or {}
    with Checkpointer(cfg["uri"], {"stage": state}, every=cfg["every"], keep=0) as ckpt:
        start = ckpt.restore(cfg.get("restore_step"))
        print(json.dumps({"restored": start}), flush=True)
        for step in range(start, cfg["steps"]):
            pipeline_step(stage, step, rank, world)
            opt.step()
            opt.zero_grad()
            future = ckpt.step()
            if future is not None and ckpt.current_step != kill.get("after_step"):
                future.result()
            if kill.get("rank") == rank and ckpt.current_step == kill["after_step"]:
                os.kill(os.getpid(), signal.SIGKILL)
    if cfg.get("out"):
        torch.save(state.state_dict(), f"{cfg['out']}.{rank}")


def dcp_load(cfg: dict[str, Any], rank: int, world: int) -> None:
    """Read a DCP checkpoint (exported by checkflow) into an FSDP2 model and its optimizer."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = wrap(build_model(), cfg["kind"], world)
    sd = {"model": get_model_state_dict(model)}
    dcp.load(sd, checkpoint_id=cfg["dcp"])
    set_model_state_dict(model, sd["model"])
    dump(model, None, cfg.get("out"), rank)


def mesh_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"a": torch.randn(7, 10, generator=g), "b": torch.randn(9, generator=g)}


def mesh2d(cfg: dict[str, Any], rank: int, world: int) -> None:
    """Save (or restore) DTensors on a 2-D mesh: ``a`` sharded on both dims, ``b``
    replicated over the first dim and sharded over the second (tensor parallel style)."""
    full_tensors = mesh_tensors()
    module = nn.Module()
    if world == 1:
        for name, t in full_tensors.items():
            module.register_parameter(name, nn.Parameter(torch.zeros_like(t)))
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2, world // 2))
        placements = {"a": [Shard(0), Shard(1)], "b": [Replicate(), Shard(0)]}
        for name, t in full_tensors.items():
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(t, mesh, placements[name]))
            )
    with Checkpointer(cfg["uri"], {"model": module}, every=1000, rng=False) as ckpt:
        if cfg.get("save"):
            ckpt.save().result()
        else:
            ckpt.restore()
    dump(module, None, cfg.get("out"), rank)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        scenarios = {
            "train": train,
            "restore": restore,
            "pipeline": train_pipeline,
            "dcp_load": dcp_load,
            "mesh2d": mesh2d,
        }
        scenarios[cfg["scenario"]](cfg, rank, world)
    finally:
        dist.destroy_process_group()


def exit_without_finalizing(code: int) -> NoReturn:
    """End this rank with ``os._exit``, after flushing what it reports.

    ``destroy_process_group`` does not stop gloo's worker threads here: DDP, FSDP2 and DTensor
    keep the process group alive inside torch. Such a thread releases a finished collective's
    tensors after it has woken the caller, and releasing a tensor that Python knows takes the
    GIL. When the main thread has reached interpreter finalization by then, CPython ends the
    thread with ``pthread_exit``, whose unwinding through a ``noexcept`` destructor calls
    ``std::terminate``: SIGABRT, "terminate called without an active exception"
    (pytorch/pytorch#38228). Skipping finalization leaves nothing for those threads to race
    with; everything this rank reports is in files written and closed, or on stdout/stderr.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        exit_without_finalizing(1)
    exit_without_finalizing(0)
