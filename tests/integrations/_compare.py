"""Bitwise comparison of the final states the integration jobs write (torch.save)."""

from __future__ import annotations

from typing import Any

import torch


def tensor_bytes(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """dtype, shape and the raw bytes: equal only when every bit is."""
    shape = tuple(t.shape)
    t = t.detach().contiguous().cpu().reshape(-1)
    return str(t.dtype), shape, t.view(torch.uint8).numpy().tobytes()


def as_bytes(value: Any) -> Any:
    """``value`` with every tensor replaced by its dtype, shape and bytes (floats as bits)."""
    if isinstance(value, torch.Tensor):
        return tensor_bytes(value)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64).view(torch.int64).item()
    if isinstance(value, dict):
        return {k: as_bytes(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_bytes(v) for v in value]
    return value


def differing(a: dict[str, Any], b: dict[str, Any], keys: list[str]) -> list[str]:
    """The keys among ``keys`` whose values are not bitwise equal in ``a`` and ``b``."""
    return [k for k in keys if as_bytes(a[k]) != as_bytes(b[k])]
