"""State objects <-> a flat ``{fqn: tensor}`` plus a skeleton of everything else.

``flatten`` walks each object's ``state_dict()`` and pulls out every tensor under a dotted
name (``model.layer.0.weight``, ``optim.state.0.exp_avg``). What is left, the *skeleton*,
keeps the nesting and the small non-tensor values (step counters, hyper-parameters, sampler
positions), with ``TensorRef`` placeholders where tensors were. ``unflatten`` puts loaded
tensors back into the skeleton, and ``load_into`` hands each state_dict to its object.

The skeleton is stored as data (``checkflow.objects``), never as a pickle unless the user
opts in: ``flatten`` refuses a value that is not data on the training thread, at the first
checkpoint, naming where it is in the state.
"""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from checkflow import tree, xla
from checkflow.objects import TensorRef, UnstorableObjectError, is_storable, is_storable_key

log = logging.getLogger(__name__)

RNG_KEY = "rng"


@runtime_checkable
class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


@dataclass(slots=True)
class FlatState:
    tensors: dict[str, torch.Tensor]
    """Every tensor, by fqn, in state_dict order (they alias the live state)."""
    skeleton: dict[str, Any]
    """``{name: state_dict with TensorRef leaves}``; a deep copy, safe to keep."""


def check_state(state: Mapping[str, Any]) -> None:
    """Reject what ``flatten`` could not save, before any training happens.

    Raises:
        TypeError: an object has no ``state_dict``/``load_state_dict``.
        ValueError: a name is empty, has a dot, or is reserved.
    """
    if not isinstance(state, Mapping) or not state:
        raise TypeError("state must be a non-empty dict of name -> stateful object")
    for name, obj in state.items():
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"state name {name!r} must be a non-empty string without dots")
        if name == RNG_KEY:
            raise ValueError(f"state name {RNG_KEY!r} is reserved for RNG states (rng=True)")
        if not isinstance(obj, Stateful):
            raise TypeError(
                f"state[{name!r}] is a {type(obj).__name__}, which has no "
                "state_dict()/load_state_dict(); wrap it in an object that has them"
            )


def flatten(
    state: Mapping[str, Any], *, rng: bool = False, allow_pickle: bool = False
) -> FlatState:
    """Snapshot the structure of ``state``; tensors are referenced, not copied.

    Raises:
        UnstorableObjectError: a value is not storable as data (``checkflow.objects``) and
            ``allow_pickle`` is False.
    """
    tensors: dict[str, torch.Tensor] = {}
    skeleton: dict[str, Any] = {}
    for name, obj in state.items():
        skeleton[name] = _extract(obj.state_dict(), name, tensors, allow_pickle)
    if rng:
        skeleton[RNG_KEY] = _extract(rng_state(), RNG_KEY, tensors, allow_pickle)
    # The skeleton's small values (scheduler lists, sampler positions) may be mutated by the
    # next training step while the persist runs; a deep copy freezes them now.
    return FlatState(tensors=tensors, skeleton=copy.deepcopy(skeleton))


def _extract(value: Any, fqn: str, out: dict[str, torch.Tensor], allow_pickle: bool) -> Any:
    def check_key(key: Any, path: str) -> None:
        if not is_storable_key(key):
            raise UnstorableObjectError(f"{path}.{key} (a key)", key)

    def leaf(v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor):
            if path in out:
                raise ValueError(f"two tensors map to the same name {path!r}")
            out[path] = v
            return TensorRef(path)
        if not allow_pickle and not is_storable(v):
            raise UnstorableObjectError(path, v)
        return v

    return tree.map_tree(value, leaf, fqn, check_key=None if allow_pickle else check_key)


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The skeleton with every ``TensorRef`` replaced by its tensor.

    Raises:
        KeyError: a tensor the skeleton names is missing.
    """

    def leaf(v: Any, _path: str) -> Any:
        if not isinstance(v, TensorRef):
            return v
        try:
            return tensors[v.fqn]
        except KeyError:
            raise KeyError(f"checkpoint has no tensor {v.fqn!r}") from None

    return tree.map_tree(skeleton, leaf)


def iter_refs(skeleton: Any) -> Iterator[str]:
    """Every fqn a skeleton refers to."""
    for _path, v in tree.iter_leaves(skeleton):
        if isinstance(v, TensorRef):
            yield v.fqn


def load_into(state: Mapping[str, Any], state_dicts: Mapping[str, Any]) -> None:
    """Hand each object its state_dict; restores RNG states when they were saved.

    Raises:
        KeyError: the checkpoint lacks one of the objects in ``state``.
    """
    missing = [name for name in state if name not in state_dicts]
    if missing:
        raise KeyError(f"checkpoint has no state for {missing}; it holds {sorted(state_dicts)}")
    for name, obj in state.items():
        # A restore gives SPMD-sharded XLA parameters sharded XLA tensors; copying one
        # into a module's parameter would leave it replicated (``xla.shardings_kept``).
        with xla.shardings_kept(_xla_tensors(obj)):
            obj.load_state_dict(_refilled_on_xla(obj, state_dicts[name]))
    if RNG_KEY in state_dicts:
        set_rng_state(state_dicts[RNG_KEY])


def _xla_tensors(obj: Any) -> list[torch.Tensor]:
    """The parameters and buffers of ``obj`` that live on an XLA device (none unless a module)."""
    if not isinstance(obj, torch.nn.Module):
        return []
    return [t for t in obj.state_dict(keep_vars=True).values() if _on_xla(t)]


def _on_xla(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and xla.is_xla(t)


def _refilled_on_xla(obj: Any, state_dict: Any) -> Any:
    """An optimizer's ``state_dict`` whose host tensors for state that lives on an XLA
    device are copied into that live state, which stands in for them (as DCP loads in place).

    ``Optimizer.load_state_dict`` moves each state tensor to its parameter's device with
    ``.to()``: one new device buffer per tensor. On XLA:CPU that much new device memory was
    most of a restore (0.7-1.0 s of ~1.1 s for 576 MiB of AdamW state); copied into the
    buffers the live state already holds, ``.to()`` has nothing left to move. Anything else
    (no live state yet, another shape, SPMD state already placed) is left to ``.to()``.
    """
    if not isinstance(obj, torch.optim.Optimizer) or not isinstance(state_dict, Mapping):
        return state_dict
    saved = state_dict.get("state")
    if not isinstance(saved, Mapping) or not obj.state:
        return state_dict
    params = [p for group in obj.param_groups for p in group["params"]]
    state: dict[Any, Any] = {}
    for index, entries in saved.items():
        live = (
            obj.state.get(params[index])
            if isinstance(index, int) and 0 <= index < len(params)
            else None
        )
        if not isinstance(live, Mapping) or not isinstance(entries, Mapping):
            state[index] = entries
            continue
        state[index] = {key: _refill(live.get(key), value) for key, value in entries.items()}
    return {**state_dict, "state": state}


def _refill(live: Any, value: Any) -> Any:
    """``live`` holding ``value``'s data when it is a like-shaped, unsharded XLA tensor
    and ``value`` a host tensor; else ``value``."""
    if not (_on_xla(live) and isinstance(value, torch.Tensor) and not _on_xla(value)):
        return value
    if live.shape != value.shape or live.dtype != value.dtype or xla.is_sharded(live):
        return value
    with torch.no_grad():
        live.copy_(value)
    return live


def rng_state() -> dict[str, Any]:
    """torch (CPU, every CUDA device, the XLA device's seed), numpy and Python RNG states."""
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    if (seed := xla.rng_state()) is not None:
        out["xla"] = seed
    try:
        import numpy as np

        out["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional for users; torch runs without it
        pass
    return out


def set_rng_state(saved: Mapping[str, Any]) -> None:
    torch.set_rng_state(saved["torch"])
    random.setstate(_to_tuple(saved["python"]))
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    if "xla" in saved:
        xla.set_rng_state(saved["xla"])
    if "numpy" in saved:
        import numpy as np

        np.random.set_state(saved["numpy"])


def _to_tuple(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_to_tuple(v) for v in value)
    return value
