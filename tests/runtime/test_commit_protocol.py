"""Who commits a step: the protocol chosen for a job, and the coordinator's fallback."""

from __future__ import annotations

from checkflow.write.commit import (
    CommitProtocol,
    CoordinatorCommit,
    RankResult,
    SingleProcessCommit,
    commit_protocol,
)


class _Reporter:
    """A coordinator client's report_persisted: a fixed answer, and the calls it saw."""

    def __init__(self, answer: bool | None) -> None:
        self.answer = answer
        self.calls: list[tuple[int, int, float, str]] = []

    def report_persisted(
        self, step: int, nbytes: int, duration_s: float, manifest_path: str, kind=None
    ):
        self.calls.append((step, nbytes, duration_s, manifest_path))
        return self.answer


class _Never(CommitProtocol):
    def rank_persisted(self, step: int, rank: RankResult) -> bool:
        return False


def _result(step: int = 4) -> RankResult:
    return RankResult(
        step=step, rank=1, manifest_path="step-000000004/r1.json", nbytes=9, duration_s=0.5
    )


def test_a_single_process_without_a_coordinator_always_commits():
    protocol = commit_protocol(None, None)
    assert isinstance(protocol, SingleProcessCommit)
    assert protocol.rank_persisted(4, _result())


def test_ranks_without_a_coordinator_use_the_cross_rank_protocol():
    ranks = _Never()
    assert commit_protocol(ranks, None) is ranks


def test_the_coordinators_answer_decides_and_it_hears_what_the_rank_stored():
    reporter = _Reporter(answer=False)
    protocol = commit_protocol(None, reporter)
    assert isinstance(protocol, CoordinatorCommit)
    assert protocol.rank_persisted(4, _result()) is False  # a single process would commit
    assert reporter.calls == [(4, 9, 0.5, "step-000000004/r1.json")]


def test_without_a_coordinator_answer_the_local_protocol_decides():
    assert commit_protocol(None, _Reporter(answer=None)).rank_persisted(4, _result())
    assert not commit_protocol(_Never(), _Reporter(answer=None)).rank_persisted(4, _result())
