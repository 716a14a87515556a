"""The layout rule on its own (``validate.check_layout``, pure): which sets of boxes make a
whole tensor. The SPMD replica rule is here on CPU; the XLA lane exercises it for real."""

from __future__ import annotations

import pytest

from checkflow import manifest as mf
from checkflow.validate import DamagedStepError, check_layout


def box(offset: list[int], shape: list[int], *, file: str = "r.bin") -> mf.ChunkEntry:
    return mf.ChunkEntry(
        fqn="model.w",
        dtype="float32",
        global_shape=[64, 8],
        offset=offset,
        shape=shape,
        codec="raw",
        file=file,
        byte_offset=0,
        nbytes=4 * shape[0] * shape[1],
        checksum="0" * 16,
    )


def test_the_same_box_from_two_ranks_is_a_replica_not_an_overlap():
    # Under SPMD every host writes what every device holds: the same whole box, twice.
    check_layout(1, [(0, box([0, 0], [64, 8])), (1, box([0, 0], [64, 8]))], complete=True)


def test_halves_replicated_on_every_rank_cover_the_tensor_once():
    halves = [box([0, 0], [32, 8]), box([32, 0], [32, 8])]
    check_layout(1, [(r, h) for r in range(3) for h in halves], complete=True)


def test_the_same_box_twice_within_one_rank_overlaps():
    with pytest.raises(DamagedStepError, match="overlaps rank 0"):
        check_layout(1, [(0, box([0, 0], [32, 8])), (0, box([0, 0], [32, 8]))], complete=False)


def test_a_replica_does_not_stand_for_the_missing_half():
    # Rank 1 repeats rank 0's rows 0..31; rows 32..63 exist nowhere.
    parts = [(0, box([0, 0], [32, 8])), (1, box([0, 0], [32, 8]))]
    with pytest.raises(DamagedStepError, match="cover 256 of 512"):
        check_layout(1, parts, complete=True)


def test_a_shifted_box_of_another_rank_is_an_overlap_not_a_replica():
    parts = [(0, box([0, 0], [32, 8])), (1, box([16, 0], [32, 8])), (1, box([48, 0], [16, 8]))]
    with pytest.raises(DamagedStepError, match="overlaps rank 0"):
        check_layout(1, parts, complete=True)
