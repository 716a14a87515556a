"""Describing a skeleton without unpickling it (in-process)."""

from __future__ import annotations

import json

from checkflow.cli.describe import jsonable, object_leaves
from checkflow.state import TensorRef


def test_skeleton_metadata_is_json_with_tensor_refs_and_reprs() -> None:
    skeleton = {"m": {"w": TensorRef("m.w")}, "lr": 0.1, "t": (1, None), "x": float("nan")}
    assert json.loads(json.dumps(jsonable(skeleton))) == {
        "m": {"w": {"$tensor": "m.w"}},
        "lr": 0.1,
        "t": [1, None],
        "x": "nan",
    }


def test_object_leaves_name_every_non_tensor_leaf_and_summarize_long_lists() -> None:
    skeleton = {"m": {"w": TensorRef("m.w")}, "lr": 0.1, "t": (1, "a"), "big": list(range(17))}
    assert dict(object_leaves(skeleton)) == {
        "lr": "0.1",
        "t.0": "1",
        "t.1": "'a'",
        "big": "<list of 17 items>",
    }
    assert list(object_leaves(b"x" * 100)) == [("*", repr(b"x" * 100)[:57] + "...")]
