"""A checkpoint's kind at the coordinator (shown by the dashboard): the rule of
``MANIFEST.json`` (a delta as soon as one part is), on plain objects."""

from __future__ import annotations

import pytest
from checkflow_server.domain import checkpoints, jobs, ranks
from checkflow_server.domain.checkpoints import combined_kind
from checkflow_server.domain.views import checkpoint_public

from checkflow.protocol import CheckpointKind, JobCreate, PartReport, RegisterRequest

FULL, DELTA = CheckpointKind.FULL, CheckpointKind.DELTA


@pytest.mark.parametrize(
    ("so_far", "part", "kind"),
    [
        (None, None, None),
        (None, FULL, FULL),
        (None, DELTA, DELTA),
        (FULL, DELTA, DELTA),
        (DELTA, FULL, DELTA),
        (FULL, None, FULL),
        (DELTA, None, DELTA),
    ],
)
def test_a_checkpoint_is_a_delta_once_any_part_is_one(so_far, part, kind) -> None:
    assert combined_kind(so_far, part) == kind


def test_the_reported_kinds_make_the_checkpoints_kind_in_its_public_view() -> None:
    job, _ = jobs.create_job(JobCreate(name="j", world_size=3), 1.0, warmup_interval=10)
    for r in range(3):
        ranks.register(job, r, RegisterRequest(instance=f"p{r}"), 1.0)
    seen = []
    for rank, kind in enumerate((FULL, DELTA, FULL)):
        body = PartReport(generation=1, nbytes=1, duration_s=0.1, manifest_path="m", kind=kind)
        checkpoints.report_part(job, 5, rank, body, 2.0)
        seen.append(checkpoint_public(job, job.checkpoints[5]).kind)
    assert seen == [FULL, DELTA, DELTA]


def test_a_report_without_a_kind_is_accepted_and_leaves_it_unknown() -> None:
    """Ranks of an older checkflow send no kind; storage-found checkpoints have none."""
    body = PartReport.model_validate(
        {"generation": 1, "nbytes": 1, "duration_s": 0.1, "manifest_path": "m"}
    )
    assert body.kind is None
    with pytest.raises(ValueError, match="kind"):
        PartReport.model_validate(
            {"generation": 1, "nbytes": 1, "duration_s": 0.1, "manifest_path": "m", "kind": "x"}
        )
