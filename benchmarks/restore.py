"""Restore time per codec against ``torch.load``: the restore column of ``overhead.py``, alone.

The state is ``overhead.py``'s (MLP + AdamW, 288 MiB by default), trained a few steps. Each
case writes its checkpoint once (fsynced, so the files are in the page cache as in
``overhead.py``), then every repeat restores every case once, in an order rotated per repeat
(interleaved: the load of a shared machine drifts over minutes). Cases:

- ``torch.load``: ``torch.load`` + ``load_state_dict`` of ``torch.save``'s file (the reference);
- ``exact`` / ``zstd`` / ``q8``: ``Checkpointer(codec=...).restore()`` of a full checkpoint;
- ``q8-delta`` (any ``<codec>-delta``): the newest checkpoint is the last of ``--chain``
  deltas (one training step apart) after a full one, so restore decodes the whole chain of
  every chunk (9 by default: the longest chain ``full_every=10`` allows).

Prints median restore time with [min..max] and the ratio to ``torch.load`` per repeat (each
repeat's case over the same repeat's ``torch.load``), then PASS/MISS against ≤ 1.2x.

    python benchmarks/restore.py                       # exact, zstd, q8, q8-delta; 7 repeats
    python benchmarks/restore.py --cases zstd,q8-delta --repeats 11
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median, table  # noqa: E402
from overhead import build, layers_for, train_step  # noqa: E402

TARGET = 1.2


class Case:
    def __init__(self, name: str, root: str) -> None:
        self.name, self.root = name, root

    def write(self, model: torch.nn.Module, opt: torch.optim.Optimizer, batches: list) -> None:
        raise NotImplementedError

    def restore(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        raise NotImplementedError


class TorchLoad(Case):
    def write(self, model, opt, batches) -> None:  # type: ignore[no-untyped-def]
        os.makedirs(self.root, exist_ok=True)
        self.path = os.path.join(self.root, "state.pt")
        with open(self.path, "wb") as f:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    def restore(self, model, opt) -> None:  # type: ignore[no-untyped-def]
        sd = torch.load(self.path)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])


class CheckflowCase(Case):
    def __init__(self, name: str, root: str, chain: int = 9) -> None:
        super().__init__(name, root)
        self.chain = chain
        self.codec = name.removesuffix("-delta")
        self.delta = name.endswith("-delta")

    def _checkpointer(self, model, opt):  # type: ignore[no-untyped-def]
        from checkflow import Checkpointer

        return Checkpointer(
            self.root, {"model": model, "optim": opt}, every=1, codec=self.codec, rng=False
        )

    def write(self, model, opt, batches) -> None:  # type: ignore[no-untyped-def]
        ckpt = self._checkpointer(model, opt)
        ckpt.open()
        try:
            ckpt.save().result()
            for i in range(self.chain if self.delta else 0):  # one step between deltas
                train_step(model, opt, batches[i % len(batches)])
                ckpt.save().result()
        finally:
            ckpt.close()

    def restore(self, model, opt) -> None:  # type: ignore[no-untyped-def]
        ckpt = self._checkpointer(model, opt)
        try:
            if ckpt.restore() is None:
                raise SystemExit(f"{self.name}: nothing restored from {self.root}")
        finally:
            ckpt.close()


def make(name: str, root: str, chain: int) -> Case:
    return TorchLoad(name, root) if name == "torch.load" else CheckflowCase(name, root, chain)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", default="exact,zstd,q8,q8-delta")
    p.add_argument("--params-mib", type=float, default=96.0)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--chain",
        type=int,
        default=9,
        help="deltas after the full checkpoint in a <codec>-delta case (9: the longest chain "
        "the default full_every=10 allows)",
    )
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    layers = layers_for(args.params_mib, args.hidden)
    torch.set_num_threads(1)  # as overhead.py: restore's own threads are what is measured
    torch.manual_seed(0)
    batches = [(torch.randn(64, args.hidden), torch.randn(64, args.hidden)) for _ in range(4)]
    model, opt = build(args.hidden, layers)
    for b in batches:
        train_step(model, opt, b)
    base = tempfile.mkdtemp(prefix="checkflow-restore-", dir=args.dir)
    names = ["torch.load", *[c for c in args.cases.split(",") if c]]
    cases = [make(n, os.path.join(base, n), args.chain) for n in names]
    try:
        for c in cases:
            m, o = build(args.hidden, layers)
            m.load_state_dict(model.state_dict())
            o.load_state_dict(opt.state_dict())
            c.write(m, o, batches)
        times: dict[str, list[float]] = {n: [] for n in names}
        target_model, target_opt = build(args.hidden, layers)
        train_step(target_model, target_opt, batches[0])  # optimizer state exists
        for r in range(args.repeats):
            order = cases[r % len(cases) :] + cases[: r % len(cases)]
            for c in order:
                gc.collect()
                t0 = time.perf_counter()
                c.restore(target_model, target_opt)
                times[c.name].append(time.perf_counter() - t0)
        load = times["torch.load"]
        print(
            f"state {sum(t.numel() * 4 for t in model.state_dict().values()) * 3 / 2**20:.0f} MiB"
            f" (model + AdamW), {args.repeats} interleaved repeats, torch threads 1, "
            f"load average {os.getloadavg()[0]:.2f}"
        )
        rows, verdicts = [], []
        for n in names:
            ts = times[n]
            ratios = [t / lt for t, lt in zip(ts, load, strict=True)]
            rows.append(
                [
                    n,
                    f"{median(ts):.3f} s [{min(ts):.3f}..{max(ts):.3f}]",
                    f"{median(ratios):.2f}x [{min(ratios):.2f}..{max(ratios):.2f}]",
                ]
            )
            if n != "torch.load":
                ok = median(ratios) <= TARGET
                verdicts.append(
                    f"{'PASS' if ok else 'MISS'} restore {n}: {median(ratios):.2f}x torch.load "
                    f"per repeat, median (target <= {TARGET}x)"
                )
        print(table(["case", "restore (median [min..max])", "/ torch.load (per repeat)"], rows))
        print("\n".join(verdicts))
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
