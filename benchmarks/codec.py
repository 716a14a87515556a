"""Codec benchmark: bytes per checkpoint (sparse and dense training state) and throughput.

    .venv/bin/python benchmarks/codec.py                 # 1 GiB embedding table, ~290 MiB MLP
    .venv/bin/python benchmarks/codec.py --size 0.25     # smaller sparse table
    .venv/bin/python benchmarks/codec.py --only speed    # one part: sparse | dense | speed

Ratios are bytes written by a checkpoint over the bytes of a full exact one (``exact``).
Chunks are cut as the persist does: rows along dim 0, at most 64 MiB each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkflow.codec import get_codec  # noqa: E402
from checkflow.codec.delta import DeltaCodec  # noqa: E402
from checkflow.codec.quant import Q2Codec, Q4Codec, Q8Codec  # noqa: E402

CHUNK = 64 << 20


def chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """Row slices of at most 64 MiB (the persist's chunking of a 2-D+ tensor)."""
    if t.dim() == 0 or t.numel() * t.element_size() <= CHUNK:
        return [t]
    rows = max(1, CHUNK // (t[0].numel() * t.element_size()))
    return [t[i : i + rows] for i in range(0, t.shape[0], rows)]


class Chain:
    """One codec's encode refs and restored state for a dict of tensors, chunk by chunk."""

    def __init__(self, codec) -> None:
        self.codec = codec
        self.refs: dict[tuple[str, int], object] = {}
        self.restored: dict[tuple[str, int], torch.Tensor] = {}

    def checkpoint(self, state: dict[str, torch.Tensor], decode: bool = True) -> tuple[int, float]:
        """Encode (and restore) every chunk; returns (bytes written, encode seconds)."""
        total, enc_s = 0, 0.0
        for name, t in state.items():
            for i, c in enumerate(chunks(t)):
                key = (name, i)
                t0 = time.perf_counter()
                enc, self.refs[key] = self.codec.encode(c.contiguous(), self.refs.get(key))
                enc_s += time.perf_counter() - t0
                total += enc.nbytes
                if decode:
                    data = b"".join(bytes(memoryview(b)) for b in enc.data)
                    base = self.restored.get(key) if enc.delta else None
                    self.restored[key] = self.codec.decode(
                        data, enc.params, dtype=c.dtype, shape=tuple(c.shape), base=base
                    )
        return total, enc_s

    def restored_tensor(self, name: str, like: torch.Tensor) -> torch.Tensor:
        parts = [self.restored[(name, i)] for i in range(len(chunks(like)))]
        return torch.cat([p.reshape(-1) for p in parts]).reshape(like.shape)


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def sparse(size_gib: float, intervals: int, frac: float, dim: int) -> None:
    rows = int(size_gib * (1 << 30)) // (dim * 4)
    print(f"\n## Sparse: embedding {rows} x {dim} fp32 ({rows * dim * 4 / 2**30:.2f} GiB), "
          f"{frac:.0%} of rows change per interval, {intervals} deltas")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    table = torch.randn(rows, dim, generator=g) * 0.05
    full = table.numel() * 4
    floor = {"delta": frac, "q8": frac * 8 / 32, "q4": frac * 4 / 32, "q2": frac * 2 / 32}
    targets = {"delta": 1 / 48, "q8": 1 / 170, "q4": 1 / 300, "q2": None}
    print("| codec | worst ratio | mean ratio | 1/worst | floor 1/x | target | max error "
          "| encode s/ckpt |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for name in ("delta", "q8", "q4", "q2"):
        t = table.clone()
        chain = Chain(get_codec(name) if name != "q2" else Q2Codec())
        chain.checkpoint({"emb": t}, decode=True)
        ratios, enc_times = [], []
        for step in range(intervals):
            ids = torch.randperm(rows, generator=g)[: int(rows * frac)]
            # Adagrad-like row updates: small next to the values.
            t[ids] += 1e-3 * torch.randn(len(ids), dim, generator=g)
            size, enc_s = chain.checkpoint({"emb": t}, decode=True)
            ratios.append(size / full)
            enc_times.append(enc_s)
            del step
        out = chain.restored_tensor("emb", t)
        err = float((out - t).abs().max())
        target = targets[name]
        ok = "" if target is None else (" ok" if max(ratios) <= target else " MISSED")
        print(f"| {name} | {max(ratios):.5f} | {statistics.mean(ratios):.5f} | "
              f"1/{1 / max(ratios):.0f} | 1/{1 / floor[name]:.0f} | "
              f"{'-' if target is None else f'1/{1 / target:.0f}'}{ok} | {err:.2e} | "
              f"{statistics.median(enc_times):.2f} |")  # fmt: skip
        del chain, out, t


class MLP(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def train_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v.detach() for k, v in model.state_dict().items()}
    for pid, (_p, s) in enumerate(opt.state.items()):
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                state[f"optim.{pid}.{k}"] = v
    return {k: v.clone() for k, v in state.items()}


def dense(width: int, depth: int, checkpoints: int, steps_between: int, warmup: int) -> None:
    torch.manual_seed(0)
    model = MLP(width, depth)
    teacher = MLP(width, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train(n: int) -> None:
        for _ in range(n):
            x = torch.randn(32, width)
            loss = torch.nn.functional.mse_loss(model(x), teacher(x).detach())
            loss.backward()
            opt.step()
            opt.zero_grad()

    train(warmup)  # the first (full) checkpoint comes after this many steps
    state = train_state(model, opt)
    full = nbytes(state)
    print(f"\n## Dense: MLP {depth} x Linear({width}, {width}) + AdamW, "
          f"{full / 2**20:.0f} MiB of state, first checkpoint at step {warmup}, "
          f"{steps_between} steps between checkpoints, "
          f"{checkpoints} deltas")  # fmt: skip
    chains = {
        "delta": Chain(DeltaCodec()),
        "q8": Chain(Q8Codec()),
        "q4": Chain(Q4Codec()),
        "q2": Chain(Q2Codec()),
    }
    for c in chains.values():
        c.checkpoint(state)
    ratios: dict[str, list[float]] = {k: [] for k in chains}
    err_sq: dict[str, float] = {k: 0.0 for k in chains}
    err_w: dict[str, float] = {k: 0.0 for k in chains}
    for _ in range(checkpoints):
        train(steps_between)
        state = train_state(model, opt)
        for name, c in chains.items():
            size, _ = c.checkpoint(state)
            ratios[name].append(size / full)
            for k, v in state.items():
                if not v.dtype.is_floating_point or v.dim() == 0:
                    continue
                out = c.restored_tensor(k, v)
                if k.endswith("exp_avg_sq"):
                    rel = float(((out - v).abs() / v.abs().clamp_min(1e-30)).max())
                    err_sq[name] = max(err_sq[name], rel)
                elif k.startswith("model."):
                    rel = float((out - v).abs().max() / v.abs().max())
                    err_w[name] = max(err_w[name], rel)
    targets = {"delta": 0.75, "q8": 0.27, "q4": 0.145, "q2": None}
    print(
        "| codec | worst ratio | mean ratio | target | max rel err exp_avg_sq "
        "| max err weights / max weight |\n|---|---|---|---|---|---|"
    )
    for name in chains:
        t = targets[name]
        ok = "-" if t is None else f"{t}{' ok' if max(ratios[name]) <= t else ' MISSED'}"
        print(f"| {name} | {max(ratios[name]):.4f} | {statistics.mean(ratios[name]):.4f} | {ok} "
              f"| {err_sq[name]:.2e} | {err_w[name]:.2e} |")  # fmt: skip


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def speed(mib: int, repeat: int) -> None:
    torch.set_num_threads(1)
    n = mib * (1 << 20) // 4
    print(f"\n## Throughput, one core: a {mib} MiB fp32 chunk in which every block changes "
          f"(small updates); GB/s of input, median of {repeat}")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(n // 1024, 1024, generator=g)
    x1 = x0 + 1e-3 * torch.randn(x0.shape, generator=g)
    x2 = x1 + 1e-3 * torch.randn(x0.shape, generator=g)
    copy = torch.empty_like(x0)
    memcpy = _median_time(lambda: copy.copy_(x1), repeat)
    print(f"(memcpy of the chunk on this machine now: {x0.nbytes / memcpy / 1e9:.2f} GB/s)")
    print("| codec | path | encode GB/s | decode GB/s | ratio |\n|---|---|---|---|---|")
    cases = [
        ("exact", "-", get_codec("exact")),
        ("zstd", "-", get_codec("zstd")),
        ("delta", "native", DeltaCodec()),
        ("delta", "torch", DeltaCodec(native=False)),
        ("q8", "native", Q8Codec()),
        ("q8", "torch", Q8Codec(native=False)),
        ("q4", "native", Q4Codec()),
        ("q4", "torch", Q4Codec(native=False)),
        ("q2", "native", Q2Codec()),
    ]
    for name, path, codec in cases:
        _, ref = codec.encode(x0, None)
        state = {"ref": ref, "i": 0}

        def enc(codec=codec, state=state):
            # Alternate x1/x2 so every call sees a real change from the previous snapshot.
            x = (x1, x2)[state["i"] % 2]
            state["i"] += 1
            state["enc"], state["ref"] = codec.encode(x, state["ref"])

        reps = repeat if path != "torch" else max(2, repeat // 3)
        t_enc = _median_time(enc, reps)
        e = state["enc"]
        data = b"".join(bytes(memoryview(b)) for b in e.data)
        base = x1  # any base of the right shape times the same
        t_dec = _median_time(
            lambda codec=codec, e=e, data=data, base=base: codec.decode(
                data, e.params, dtype=x0.dtype, shape=tuple(x0.shape), base=base
            ),
            reps,
        )
        print(f"| {name} | {path} | {x0.nbytes / t_enc / 1e9:.2f} | "
              f"{x0.nbytes / t_dec / 1e9:.2f} | {e.nbytes / x0.nbytes:.4f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=1.0, help="sparse table size, GiB")
    ap.add_argument("--intervals", type=int, default=20, help="sparse deltas")
    ap.add_argument("--frac", type=float, default=0.02, help="fraction of rows changed")
    ap.add_argument("--dim", type=int, default=64, help="embedding dim")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--checkpoints", type=int, default=5, help="dense deltas")
    ap.add_argument("--steps", type=int, default=3, help="training steps between checkpoints")
    ap.add_argument("--warmup", type=int, default=20, help="training steps before the full one")
    ap.add_argument("--speed-mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--only", choices=["sparse", "dense", "speed"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}")
    if args.only in (None, "speed"):
        speed(args.speed_mib, args.repeat)
    if args.only in (None, "sparse"):
        sparse(args.size, args.intervals, args.frac, args.dim)
    if args.only in (None, "dense"):
        dense(args.width, args.depth, args.checkpoints, args.steps, args.warmup)


if __name__ == "__main__":
    main()
