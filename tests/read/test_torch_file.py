"""``plain_values``: what ``restore --format torch`` changes so that plain ``torch.load``
(``weights_only=True``) reads the file, and what it names because it cannot."""

from __future__ import annotations

import io
from collections import OrderedDict, namedtuple
from fractions import Fraction

import numpy as np
import torch

from checkflow.cli.output import needs_full_install
from checkflow.read.torch_file import plain_values


def _round_trip(value: object) -> object:
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only, torch's default


def test_numpy_values_become_tensors_and_numbers_that_weights_only_reads():
    rng = np.random.get_state()
    tree = {
        "rng": {"numpy": rng, "torch": torch.get_rng_state()},
        "data": OrderedDict(seen=np.int64(7), mean=np.float32(0.5), order=np.arange(3)),
        "meta": {"dtype": torch.float16, "device": torch.device("cpu"), "blob": b"\x00"},
    }
    plain, not_plain = plain_values(tree)
    assert not_plain == []
    back = _round_trip(plain)
    assert isinstance(back["rng"]["numpy"][1], torch.Tensor)
    assert back["rng"]["numpy"][1].dtype == torch.uint32
    assert np.array_equal(back["rng"]["numpy"][1].numpy(), rng[1])
    assert back["rng"]["numpy"][0] == "MT19937" and back["rng"]["numpy"][2:] == rng[2:]
    assert back["data"]["seen"] == 7 and type(back["data"]["seen"]) is int
    assert torch.equal(back["data"]["order"], torch.arange(3))
    assert back["meta"] == tree["meta"]


def test_values_weights_only_refuses_are_kept_and_named():
    Point = namedtuple("Point", "x y")
    tree = {"extra": {"ratio": Fraction(1, 3), "names": np.array(["a", "b"]), "p": Point(1, 2)}}
    plain, not_plain = plain_values(tree)
    assert plain["extra"]["ratio"] == Fraction(1, 3)
    assert not_plain == [
        "extra.ratio (fractions.Fraction)",
        "extra.names (numpy.ndarray)",
        f"extra.p ({__name__}.Point)",
    ]


def test_only_a_missing_runtime_package_is_called_a_coordinator_only_install():
    numpy_missing = ModuleNotFoundError("No module named 'numpy'", name="numpy")
    assert needs_full_install("ls", numpy_missing) == (
        "checkflow ls needs the full install: pip install 'checkflow[full]' (this is a "
        "coordinator-only install, without numpy; only serve and status work in it)"
    )
    sub = ModuleNotFoundError("No module named 'torch.distributed'", name="torch.distributed")
    assert needs_full_install("run", sub) is not None
    assert needs_full_install("ls", ModuleNotFoundError("x", name="checkflow.nope")) is None
    assert needs_full_install("ls", ModuleNotFoundError("x")) is None
