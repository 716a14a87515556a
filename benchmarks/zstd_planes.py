"""What zstd does with each byte plane of trained fp32 state, and what decoding it costs.

A ``Linear(2048, 2048)`` + AdamW trained 3 steps (16 MiB per tensor, as one chunk of
``overhead.py``'s state). For the weight, ``exp_avg`` and ``exp_avg_sq``: each byte plane's
size after zstd level 1, the time to decompress the compressible (exponent) plane at
levels -10 to 9, and the time to encode the tensor as one zstd frame of all planes (the
codec before byte planes were stored apart) against ``ZstdCodec().encode`` now. Medians of
``--repeats`` on one thread; and the exponent plane as the codec stores it now (4-bit
codes two per byte, then zstd: ``checkflow/codec/nibbles.py``), its size and decode time.

Then the mantissa planes that compress at all in ``restore.py``'s state (the MLP + AdamW of
``overhead.py`` trained 4 steps: some optimizer rows still zero), at the codec's level 1
against zstd's fast mode (``FAST_LEVEL``: literals not Huffman-coded), which the codec
picks unless level 1 is more than ``FAST_SLACK`` smaller: size, encode and decode time.

    .venv/bin/python benchmarks/zstd_planes.py
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import zstandard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import median_time  # noqa: E402
from overhead import build, layers_for, train_step  # noqa: E402

from checkflow.codec import zstd as zstd_codec  # noqa: E402
from checkflow.codec.base import Encoded  # noqa: E402
from checkflow.codec.zstd import ZstdCodec, shuffle_bytes  # noqa: E402

LEVELS = (-10, -3, 1, 3, 9)


def trained_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    layer = torch.nn.Linear(2048, 2048)
    opt = torch.optim.AdamW(layer.parameters())
    for _ in range(3):
        layer(torch.randn(64, 2048)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    moments = opt.state[layer.weight]
    return {
        "weight": layer.weight.detach().contiguous(),
        "exp_avg": moments["exp_avg"],
        "exp_avg_sq": moments["exp_avg_sq"],
    }


def encode_one_frame(x: torch.Tensor, cctx: zstandard.ZstdCompressor) -> bytes:
    """The codec before byte planes: numpy's byte shuffle, then one frame of all of it."""
    grouped = x.reshape(-1).view(torch.uint8).numpy().reshape(-1, x.element_size())
    return cctx.compress(np.ascontiguousarray(grouped.T))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(1)
    reps = args.repeats
    for name, x in trained_state().items():
        shuffled = shuffle_bytes(x)
        n = x.numel()
        planes = [shuffled[k * n : (k + 1) * n] for k in range(4)]
        c1 = zstandard.ZstdCompressor(level=1)
        ratios = [len(c1.compress(pl)) / n for pl in planes]
        print(
            f"{name} ({x.nbytes >> 20} MiB): planes after zstd level 1 (low byte first): "
            + ", ".join(f"{r:.1%}" for r in ratios)
        )
        exponent = planes[3]
        for level in LEVELS:
            frame = zstandard.ZstdCompressor(level=level).compress(exponent)
            t = median_time(
                lambda f=frame, n=n: zstandard.ZstdDecompressor().decompress(f, max_output_size=n),
                reps,
            )
            print(
                f"  exponent plane, level {level:3d}: {len(frame) / n:.1%}, "
                f"decompress {t * 1e3:.2f} ms per {n >> 20} MiB"
            )
        _print_nibbles(ZstdCodec().encode(x)[0], n, reps)
        one_frame = median_time(lambda x=x, c=c1: encode_one_frame(x, c), reps)
        planes_now = median_time(lambda x=x: ZstdCodec().encode(x), reps)
        print(
            f"  encode: one frame of all planes {one_frame * 1e3:.1f} ms, "
            f"ZstdCodec now {planes_now * 1e3:.1f} ms"
        )
    _print_fast_mode(reps)


def _print_nibbles(enc: Encoded, n: int, reps: int) -> None:
    """What the codec stores now for the exponent plane (4-bit codes, then zstd), and what
    decoding it costs, to compare with the plain plane's lines above."""
    entry = enc.params["planes"][3]
    if entry[0] != "nib4":
        print(f"  exponent plane as stored now: {entry[0]}")
        return
    data = b"".join(bytes(memoryview(b)) for b in enc.data)
    stored = memoryview(data)[sum(e[1] for e in enc.params["planes"][:3]) :]
    t = median_time(lambda: zstd_codec._decode_nibbles(stored, entry, n, 3, True), reps)
    print(
        f"  exponent plane as stored now (4-bit codes, level 1): {entry[1] / n:.1%} "
        f"({entry[4]} escapes), decode {t * 1e3:.2f} ms per {n >> 20} MiB"
    )


def restore_state() -> dict[str, torch.Tensor]:
    """``restore.py``'s state: ``overhead.py``'s MLP + AdamW after 4 steps."""
    torch.manual_seed(0)  # as restore.py: the batches first, then the model
    batches = [(torch.randn(64, 2048), torch.randn(64, 2048)) for _ in range(4)]
    model, opt = build(2048, layers_for(96.0, 2048))
    for batch in batches:
        train_step(model, opt, batch)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
    for i, p in enumerate(model.parameters()):
        tensors.update({f"optim.{i}.{k}": v for k, v in opt.state[p].items() if v.dim()})
    return {k: v for k, v in tensors.items() if v.nbytes >= 1 << 20}


def _print_fast_mode(reps: int) -> None:
    """Level 1 against fast mode for every mantissa plane of ``restore_state`` that is not
    stored raw, summed."""
    levels = {"level 1": zstandard.ZstdCompressor(level=1)}
    levels["fast"] = zstandard.ZstdCompressor(level=zstd_codec.FAST_LEVEL)
    planes = []
    for x in restore_state().values():
        shuffled, n = shuffle_bytes(x), x.numel()
        for k in range(x.element_size() - 1):
            plane = bytes(shuffled[k * n : (k + 1) * n])
            sample = levels["level 1"].compress(plane[: zstd_codec.SAMPLE_BYTES])
            if len(sample) <= zstd_codec.RAW_RATIO * zstd_codec.SAMPLE_BYTES:
                planes.append(plane)
    mib = sum(len(p) for p in planes) / 2**20
    print(f"restore.py's state: {len(planes)} mantissa planes compress ({mib:.0f} MiB)")
    for name, cctx in levels.items():
        frames = [cctx.compress(p) for p in planes]
        encode = median_time(lambda c=cctx: [c.compress(p) for p in planes], reps)
        dctx = zstandard.ZstdDecompressor()
        decode = median_time(
            lambda fs=frames, d=dctx: [d.decompress(f, max_output_size=1 << 26) for f in fs],
            reps,
        )
        size = sum(len(f) for f in frames) / 2**20
        print(
            f"  {name:8s}: {size / mib:.1%} of them, encode {encode * 1e3:.1f} ms, "
            f"decode {decode * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
