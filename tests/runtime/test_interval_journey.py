"""Issue 32: ``every="auto"`` with a coordinator keeps a job of 3 ms steps inside its
overhead budget, and what the coordinator shows is what the ranks apply.

A real ``checkflow serve`` (uvicorn) on 127.0.0.1, a real ``Checkpointer`` on a tiny model,
steps of about 3 ms (a sleep is the workload). Before the fix the coordinator's new interval
(112) was to start at step 3120, after the run: the run checkpointed every 10 steps while
``status`` showed 112, and a job fixed at ``every=20`` was shown 13, 66, 22. The full-size
run (3,000 steps) is ``benchmarks/auto_interval.py``; these runs are shorter to stay fast.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from checkflow.cli.app import main
from checkflow.interval import DEFAULT_MAX_OVERHEAD
from tests.support.coordinator import TOKEN, ServerProcess, served
from tests.support.interval_journey import JourneyResult, run


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with served(tmp_path_factory.mktemp("coordinator") / "c.db") as s:
        yield s


@pytest.fixture
def status(
    server: ServerProcess, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[[str], Callable[[], str]]:
    """``status(job)()``: the INTERVAL cell of ``job`` in ``checkflow status URL``."""
    monkeypatch.setenv("CHECKFLOW_TOKEN", TOKEN)

    def of(job: str) -> Callable[[], str]:
        def cell() -> str:
            capsys.readouterr()
            assert main(["status", server.url]) == 0
            out = capsys.readouterr().out.splitlines()
            row = next(line for line in out if line.split()[0] == job)
            found = re.search(r"\b(\d+ (?:fixed|warmup|tuned))\b", row)
            assert found is not None, row
            return found.group(1)

        return cell

    return of


def figures(r: JourneyResult) -> str:
    return (
        f"{r.steps} steps in {r.wall_s:.2f} s, blocked {r.blocked_s:.3f} s "
        f"({100 * r.overhead:.2f} %), {r.taken} checkpoints, {r.waits} waits "
        f"({r.waited_s:.2f} s), adopted {r.adopted}, shown {r.shown and r.shown.interval}"
    )


def test_auto_with_a_coordinator_stays_in_budget_and_status_shows_what_is_applied(
    server: ServerProcess, tmp_path: Path, status: Callable[[str], Callable[[], str]]
) -> None:
    r = run(server, tmp_path, "auto", every="auto", steps=1500, status=status("auto"))
    print(figures(r))  # shown with -s
    assert r.overhead <= DEFAULT_MAX_OVERHEAD, figures(r)
    # The rank applies the coordinator's tuned interval, the one the API and status show.
    assert r.shown is not None and r.shown.schedule.mode == "tuned", figures(r)
    assert r.adopted == r.shown.interval and r.status == f"{r.adopted} tuned", figures(r)
    # Each checkpoint came the applied interval after the one before (or at once when the
    # interval shrank below the distance covered): nothing was due on an interval computed
    # far ahead with an old one, and the warm-up's 10 did not last.
    for a, b in zip(r.checkpoints, r.checkpoints[1:], strict=False):
        applied = r.intervals[a:b]  # steps a + 1 .. b
        assert b - a == applied[-1] or applied[-1] < b - a <= max(applied), (a, b, applied)
    # The tuned interval was applied: fewer checkpoints than the warm-up's every 10. How many
    # fewer depends on the measured costs, which a loaded machine changes (24 seen in CI).
    assert r.taken < 1500 // 10, figures(r)
    assert all(s.next_checkpoint > (s.restore or 0) for s in r.samples), r.samples


def test_a_fixed_every_is_shown_fixed_throughout_and_never_retuned(
    server: ServerProcess, tmp_path: Path, status: Callable[[str], Callable[[], str]]
) -> None:
    r = run(server, tmp_path, "fixed", every=20, steps=600, sample_every=50, status=status("fixed"))
    assert {(s.interval, s.mode) for s in r.samples} == {(20, "fixed")}, r.samples
    assert r.status == "20 fixed" and r.adopted == 20
    assert "interval_changed" not in [e.kind for e in server.events("fixed")]
    assert r.checkpoints == list(range(20, 601, 20)) and set(r.intervals) == {20}
    assert all(s.next_checkpoint > (s.restore or 0) for s in r.samples), r.samples
    assert all(s.next_checkpoint % 20 == 0 for s in r.samples), r.samples
