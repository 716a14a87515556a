"""Non-tensor state stored as a typed JSON tree: exact round trips, and no code runs on read."""

from __future__ import annotations

import enum
import json
import math
import pathlib
import random
import struct
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkflow import objects
from checkflow.data import ResumableSampler
from checkflow.state import TensorRef, flatten, rng_state, unflatten

# -- a strict comparison: same types, same float bits, same order ------------------------------


def assert_same(a: Any, b: Any, where: str = "tree") -> None:
    """``b`` is ``a``: same type at every node, floats bit for bit, dicts in the same order."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, float):
        assert struct.pack(">d", a) == struct.pack(">d", b), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert len(a) == len(b), where
        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True):
            assert_same(ka, kb, f"{where} key")
            assert_same(va, vb, f"{where}.{ka}")
        assert_same(getattr(a, "_metadata", None), getattr(b, "_metadata", None), where)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}.{i}")
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert (
            a.contiguous().view(-1).view(torch.uint8).tolist()
            == b.contiguous().view(-1).view(torch.uint8).tolist()
        ), where
    elif isinstance(a, np.ndarray | np.generic):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert a.tobytes() == b.tobytes(), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def round_trip(tree: Any) -> Any:
    return objects.decode(objects.encode(tree))


# -- property tests ------------------------------------------------------------------------------
special_floats = st.sampled_from(
    [
        0.0,
        -0.0,
        math.inf,
        -math.inf,
        math.nan,
        -math.nan,
        struct.unpack(">d", bytes.fromhex("7ff0000000000001"))[0],  # signaling NaN
        struct.unpack(">d", bytes.fromhex("fff8dead0000beef"))[0],  # NaN with a payload
        5e-324,  # smallest subnormal
        1.7976931348623157e308,
    ]
)
floats = st.floats(allow_nan=True, allow_infinity=True) | special_floats
ints = st.integers() | st.integers(min_value=-(2**200), max_value=2**200)
keys = st.recursive(
    st.none() | st.booleans() | ints | floats | st.text() | st.binary(max_size=16),
    lambda inner: st.tuples(inner, inner),
    max_leaves=4,
)


@st.composite
def ndarrays(draw: Any) -> np.ndarray:
    dtype = draw(st.sampled_from(["<u4", "<i8", "<f8", ">f4", "|b1", "<c16", "|u1"]))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    arr = np.frombuffer(raw, dtype=dtype).reshape(shape)
    if dtype == "|b1":
        arr = arr.astype(np.uint8).astype(bool)  # only 0/1 bytes are valid booleans
    return arr.copy()


@st.composite
def tensors(draw: Any) -> torch.Tensor:
    dtype = draw(
        st.sampled_from(
            [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]
            + [torch.uint8, torch.int8, torch.complex64, torch.bool]
        )
    )
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = draw(
        st.binary(min_size=math.prod(shape) * itemsize, max_size=math.prod(shape) * itemsize)
    )
    if not raw:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    return t.to(torch.uint8).bool() if dtype == torch.bool else t.clone()


def _odict(items: list[tuple[Any, Any]], version: int | None) -> OrderedDict[Any, Any]:
    out: OrderedDict[Any, Any] = OrderedDict(items)
    if version is not None:
        out._metadata = OrderedDict({"": {"version": version}})  # type: ignore[attr-defined]
    return out


leaves = (
    st.none()
    | st.booleans()
    | ints
    | floats
    | st.text(alphabet=st.characters(codec=None))  # surrogates too
    | st.binary(max_size=64)
    | st.builds(TensorRef, st.text(max_size=20))
    | ndarrays()
    | tensors()
    | st.sampled_from([np.float32(1.5), np.int64(-7), np.uint32(2**32 - 1), np.bool_(True)])
    | st.sampled_from([torch.float16, torch.bfloat16, torch.device("cpu"), torch.device("cuda:1")])
)
trees = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.lists(inner, max_size=5).map(tuple)
        | st.lists(st.tuples(keys, inner), max_size=5).map(lambda kv: dict(kv))
        | st.builds(_odict, st.lists(st.tuples(keys, inner), max_size=5), st.none() | ints)
        | st.lists(st.integers(0, 8), max_size=4).map(torch.Size)
    ),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees)
def test_any_tree_of_storable_values_round_trips_bit_exactly(tree: Any) -> None:
    assert_same(tree, round_trip(tree))


@settings(max_examples=200, deadline=None)
@given(floats)
def test_every_float_keeps_its_bits_including_nan_payloads_infinities_and_negative_zero(
    x: float,
) -> None:
    back = round_trip([x, {x: x} if not math.isnan(x) else {}])
    assert struct.pack(">d", back[0]) == struct.pack(">d", x)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=-(2**4000), max_value=2**4000))
def test_integers_of_any_size_round_trip(n: int) -> None:
    back = round_trip({"n": n, "t": (n,)})
    assert back["n"] == n and type(back["n"]) is int and back["t"] == (n,)


def test_a_huge_integer_is_stored_as_hex_and_read_without_python_digit_limits() -> None:
    n = 7**20000  # ~17,000 decimal digits, past int('...')'s default limit of 4,300
    assert round_trip(n) == n


# -- the state that training jobs put in checkpoints ----------------------------------------------
def _trained_optimizers() -> list[torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    out: list[torch.optim.Optimizer] = [
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
        torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.8, 0.95), amsgrad=True),
        torch.optim.AdamW(model.parameters(), lr=torch.tensor(3e-4), betas=(0.9, 0.999)),
    ]
    for opt in out:
        for _ in range(3):
            model(torch.randn(5, 4)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
    return out


def _stepped_schedulers() -> list[Any]:
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.5)
    scheds = [
        torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3),
        torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.97**e),
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=50),
        torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=3),
    ]
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # best starts at inf
    for _ in range(4):
        opt.step()
        for s in scheds:
            s.step()
        plateau.step(1.0)
    return [*scheds, plateau]


def _stateful_loader_state() -> dict[str, Any]:
    """What ``torchdata``'s ``StatefulDataLoader.state_dict()`` holds with two workers."""
    gen = torch.Generator().manual_seed(3)
    worker = {
        "worker_id": 0,
        "dataset_state": None,
        "fetcher_state": {"dataset_iter_state": None, "fetcher_ended": False},
    }
    return {
        "_snapshot": {
            "_snapshot_step": 12,
            "_last_yielded_worker_id": 1,
            "_main_snapshot": {
                "_num_workers": 2,
                "_sampler_iter_state": {"samples_yielded": 48, "generator": gen.get_state()},
                "_index_sampler_state": None,
                "_sampler_iter_yielded": 12,
                "_IterableDataset_len_called": None,
                "_shared_seed": None,
                "_base_seed": 2**63 - 25,
            },
            "_worker_snapshots": {"worker_0": worker, "worker_1": {**worker, "worker_id": 1}},
        },
        "_steps_since_snapshot": 0,
        "_iterator_finished": False,
    }


def _objects_with_state() -> dict[str, Any]:
    sampler = ResumableSampler(100, seed=4, rank=1, world_size=2)
    sampler.set_epoch(3)
    sampler.consumed_batches(5, 4)
    named: dict[str, Any] = {f"optim{i}": o for i, o in enumerate(_trained_optimizers())}
    named.update({f"sched{i}": s for i, s in enumerate(_stepped_schedulers())})
    named["sampler"] = sampler
    named["model"] = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    return named


class _Holder:
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def _stored_and_read(state: dict[str, Any], *, rng: bool = False) -> dict[str, Any]:
    """What a restore hands back: flatten, store the skeleton, read it, put tensors back."""
    flat = flatten(state, rng=rng)
    skeleton = objects.decode(objects.encode(flat.skeleton))
    return unflatten(skeleton, {k: v.clone() for k, v in flat.tensors.items()})


def _same_state(a: Any, b: Any, where: str) -> None:
    # flatten has always turned every mapping into an OrderedDict; values are what matter.
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            _same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same_state(x, y, f"{where}.{i}")
    else:
        assert_same(a, b, where)


def test_optimizer_scheduler_sampler_loader_and_module_state_round_trip_exactly() -> None:
    state = _objects_with_state()
    state["loader"] = _Holder(_stateful_loader_state())
    before = {name: obj.state_dict() for name, obj in state.items()}
    after = _stored_and_read(state)
    for name in state:
        _same_state(before[name], after[name], name)
    assert after["optim2"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert math.isinf(after["sched4"]["mode_worse"]) and after["sched1"]["lr_lambdas"] == [None]
    assert after["model"]._metadata == before["model"]._metadata  # module versions
    for name, obj in state.items():
        obj.load_state_dict(after[name])  # what a restore does; each accepts its state


def test_torch_numpy_python_and_cuda_shaped_rng_states_round_trip_and_replay_the_same_draws() -> (
    None
):
    random.seed(5)
    random.gauss(0, 1)  # leaves a cached gaussian (a float) in the state
    np.random.seed(6)
    np.random.standard_normal()  # numpy's cached gaussian
    torch.manual_seed(7)
    saved = _stored_and_read({}, rng=True)["rng"]
    expected = (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist())
    from checkflow.state import set_rng_state

    set_rng_state(saved)
    assert (random.random(), np.random.standard_normal(3).tolist(), torch.rand(3).tolist()) == (
        expected
    )
    # torch.cuda.get_rng_state_all() returns one CPU uint8 tensor per device.
    cuda_like = [torch.randint(0, 256, (16,), dtype=torch.uint8) for _ in range(2)]
    assert_same(cuda_like, round_trip(cuda_like))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rng_states_round_trip_on_a_gpu() -> None:
    torch.cuda.init()
    state = rng_state()
    back = _stored_and_read({}, rng=True)["rng"]
    assert_same(state["cuda"], back["cuda"])


# -- what is refused, and what a pickle node needs ----------------------------------------------
class _Color(enum.IntEnum):
    RED = 1


class _Point(NamedTuple):
    x: int
    y: int


class _Canary:
    """Unpickling it creates ``path``: the test's evidence that stored code ran."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (self.path,))


def test_a_function_in_the_state_is_refused_at_flatten_with_its_path_and_type() -> None:
    sched = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0), lambda e: 1.0
    )
    holder = _Holder({"fn": {"inner": [1, math.sqrt]}, "ok": sched.state_dict()})
    with pytest.raises(objects.UnstorableObjectError) as err:
        flatten({"h": holder})
    message = str(err.value)
    assert "'h.fn.inner.1'" in message and "builtin_function_or_method" in message
    assert "allow_pickle=True" in message and "\n" not in message
    flatten({"h": holder}, allow_pickle=True)  # the opt-in


@pytest.mark.parametrize(
    "value, path, type_name",
    [
        ({"s": {1, 2}}, "s", "set"),
        ({"k": {frozenset([1]): 2}}, "k.frozenset({1}) (a key)", "frozenset"),
        ({"o": np.array([object()], dtype=object)}, "o", "numpy.ndarray"),
        ({"e": [_Color.RED]}, "e.0", f"{__name__}._Color"),
        ({"n": _Point(1, 2)}, "n", f"{__name__}._Point"),
    ],
)
def test_values_that_are_not_data_are_refused_by_the_encoder(
    value: Any, path: str, type_name: str
) -> None:
    with pytest.raises(objects.UnstorableObjectError) as err:
        objects.encode(value)
    assert (err.value.path, err.value.type_name) == (path, type_name)


def test_a_pickle_node_runs_only_with_trust_and_is_opaque_otherwise(tmp_path: pathlib.Path) -> None:
    canary = tmp_path / "canary"
    stored = objects.encode({"x": [1, _Canary(canary)]}, allow_pickle=True)

    with pytest.raises(objects.PickleRefusedError) as err:
        objects.decode(stored)
    assert err.value.path == "x.1" and err.value.type_name.endswith("_Canary")
    shown = objects.decode(stored, opaque=True)["x"][1]
    assert isinstance(shown, objects.OpaqueObject) and shown.nbytes > 0
    assert "_Canary" in repr(shown)
    assert not canary.exists()

    objects.decode(stored, trust=True)
    assert canary.exists()  # the opt-in does unpickle: the refusals above were real


@pytest.mark.parametrize(
    "doc, problem",
    [
        (b"\x80\x04K\x01.", "not valid JSON"),  # a pickle where the tree should be
        (b'{"format":"checkflow.objects","version":2,"root":null}', "version 2"),
        (b'{"format":"other","version":1,"root":null}', "not a checkflow.objects"),
        (b'{"format":"checkflow.objects","version":1,"root":{"T":"eval","x":1}}', "unknown"),
        (b'{"format":"checkflow.objects","version":1,"root":NaN}', "constant NaN"),
        (
            b'{"format":"checkflow.objects","version":1,"root":'
            b'{"T":"ndarray","dtype":"|O8","shape":[1],"b64":"AAAAAAAAAAA="}}',
            "not stored inline",
        ),
        (
            b'{"format":"checkflow.objects","version":1,"root":'
            b'{"T":"tensor","dtype":"float32","shape":[3],"b64":"AAAA"}}',
            "3 bytes for a torch.float32 tensor",
        ),
        (
            b'{"format":"checkflow.objects","version":1,"root":{"T":"dict","items":[[[1],2]]}}',
            "unhashable",
        ),
        (
            b'{"format":"checkflow.objects","version":1,"root":'
            + b"[" * 100000
            + b"]" * 100000
            + b"}",
            "deep",
        ),
    ],
)
def test_damaged_or_foreign_bytes_are_a_format_error_never_an_unpickle(
    doc: bytes, problem: str
) -> None:
    with pytest.raises(objects.ObjectFormatError, match=problem):
        objects.decode(doc)


def test_stored_objects_are_plain_json_a_person_can_read() -> None:
    stored = objects.encode({"step": 7, "lr": 0.1, "w": TensorRef("model.w")})
    doc = json.loads(stored)
    assert doc["root"] == {
        "T": "dict",
        "items": [["step", 7], ["lr", 0.1], ["w", {"T": "ref", "fqn": "model.w"}]],
    }
