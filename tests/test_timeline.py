"""Rollback timelines without a disk: step folder names, TIMELINE records, lineage choice."""

from __future__ import annotations

import math

import pytest

from checkflow import timeline as tl
from checkflow.manifest import StepFolder, parse_step_dir, step_dir


@pytest.mark.parametrize(
    ("step", "timeline", "name"),
    [
        (0, 0, "step-000000000"),
        (2, 0, "step-000000002"),
        (2, 1, "step-000000002.t1"),
        (1_234_567_890, 17, "step-1234567890.t17"),
    ],
)
def test_step_folder_names_round_trip(step: int, timeline: int, name: str) -> None:
    assert step_dir(step, timeline) == name
    assert parse_step_dir(name) == StepFolder(step, timeline)
    assert parse_step_dir(f"root/{name}/") == StepFolder(step, timeline)


@pytest.mark.parametrize(
    "name",
    [
        "step-0000000099",  # not the writer's width
        "step-00000002",  # too short
        "step-00000000\u0662",  # ARABIC-INDIC DIGIT TWO
        "step-000000002.t0",  # timeline 0 has no suffix
        "step-000000002.t01",  # a leading zero
        "step-000000002.t",
        "step-000000002.t-1",
        "step-000000002.t\u0661",
        "step-000000002.tmp",
        "step-000000002 ",
        "step-000000002\n",
        "TIMELINE-1.json",
    ],
)
def test_only_canonical_names_are_steps(name: str) -> None:
    assert parse_step_dir(name) is None


def test_timeline_files_parse_only_canonical_names() -> None:
    assert tl.timeline_file(3) == "TIMELINE-3.json"
    assert tl.parse_timeline_file("TIMELINE-3.json") == 3
    for bad in ("TIMELINE-0.json", "TIMELINE-03.json", "TIMELINE-\u0663.json", "TIMELINE-3.jso"):
        assert tl.parse_timeline_file(bad) is None
    with pytest.raises(ValueError, match="has no file"):
        tl.timeline_file(0)


def test_a_record_round_trips() -> None:
    record = tl.Timeline(timeline=2, parent=1, forked_at=7)
    assert tl.parse_timeline(record.to_json(), 2) == record


@pytest.mark.parametrize(
    ("data", "why"),
    [
        (b"{not json", "not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, "over the 4096-byte cap"),
        (b"[" * 1000 + b"]" * 1000, "nests deeper"),
        (b"[1]", "exactly the fields"),
        (b'{"timeline": 2, "parent": 1}', "exactly the fields"),
        (b'{"timeline": 2, "parent": 1, "forked_at": 1, "x": 0}', "exactly the fields"),
        (b'{"timeline": 2, "parent": "1", "forked_at": 1}', "'parent' must be an integer"),
        (b'{"timeline": 2, "parent": true, "forked_at": 1}', "'parent' must be an integer"),
        (b'{"timeline": 3, "parent": 1, "forked_at": 1}', "says timeline 3, its name timeline 2"),
        (b'{"timeline": 2, "parent": 2, "forked_at": 1}', "out of range"),
        (b'{"timeline": 2, "parent": -1, "forked_at": 1}', "out of range"),
        (b'{"timeline": 2, "parent": 1, "forked_at": -2}', "out of range"),
    ],
)
def test_a_crafted_record_is_refused_with_the_reason(data: bytes, why: str) -> None:
    with pytest.raises(tl.TimelineError, match=why):
        tl.parse_timeline(data, 2)


def _records(*triples: tuple[int, int, int]) -> dict[int, tl.Timeline]:
    return {k: tl.Timeline(timeline=k, parent=p, forked_at=f) for k, p, f in triples}


def test_no_timeline_file_is_timeline_0_with_every_step() -> None:
    lineage = tl.resolve({}, {})
    assert (lineage.current, lineage.chain, lineage.highest) == (0, ((0, math.inf),), 0)
    on, off = lineage.pick([StepFolder(3), StepFolder(1), StepFolder(2, 4)])
    assert on == {1: StepFolder(1), 3: StepFolder(3)} and off == [StepFolder(2, 4)]


def test_the_lineage_is_the_newest_timeline_and_each_parent_up_to_its_fork() -> None:
    # 0: steps 1..5; 1 forked at 2 (steps 3, 4); 2 forked from 1 at 3 (steps 4, 5).
    lineage = tl.resolve(_records((1, 0, 2), (2, 1, 3)), {})
    assert lineage.current == 2
    assert lineage.chain == ((2, math.inf), (1, 3), (0, 2))
    folders = [StepFolder(s) for s in range(1, 6)]
    folders += [StepFolder(3, 1), StepFolder(4, 1), StepFolder(4, 2), StepFolder(5, 2)]
    on, off = lineage.pick(folders)
    assert on == {
        1: StepFolder(1),
        2: StepFolder(2),
        3: StepFolder(3, 1),
        4: StepFolder(4, 2),
        5: StepFolder(5, 2),
    }
    assert off == [StepFolder(3), StepFolder(4, 1), StepFolder(4), StepFolder(5)]
    assert tl.next_timeline(lineage, 4) == tl.Timeline(timeline=3, parent=2, forked_at=4)


def test_a_new_timeline_at_the_fork_step_itself_wins_over_its_parent() -> None:
    on, off = tl.resolve(_records((1, 0, 2)), {}).pick([StepFolder(2), StepFolder(2, 1)])
    assert on == {2: StepFolder(2, 1)} and off == [StepFolder(2)]


def test_a_rollback_from_scratch_abandons_every_older_step() -> None:
    on, off = tl.resolve(_records((1, 0, -1)), {}).pick([StepFolder(0), StepFolder(1, 1)])
    assert on == {1: StepFolder(1, 1)} and off == [StepFolder(0)]


@pytest.mark.parametrize(
    ("records", "ignored", "why", "after"),
    [
        (((2, 3, 1), (3, 2, 1)), {}, {2: "cycle through timeline 3", 3: "cycle"}, 4),
        (((2, 5, 1),), {}, {2: "ancestor timeline 5 does not exist"}, 3),
        (((3, 2, 1),), {2: "TIMELINE-2.json: not JSON"}, {3: "timeline 2 is unusable"}, 4),
    ],
    ids=["cycle", "missing-parent", "unreadable-parent"],
)
def test_a_broken_chain_is_ignored_and_the_next_sound_timeline_is_current(
    records: tuple[tuple[int, int, int], ...],
    ignored: dict[int, str],
    why: dict[int, str],
    after: int,
) -> None:
    lineage = tl.resolve(_records((1, 0, 4), *records), ignored)
    assert lineage.current == 1
    assert lineage.chain == ((1, math.inf), (0, 4))
    assert set(lineage.ignored) == set(why) | set(ignored)
    for k, reason in why.items():
        assert reason in lineage.ignored[k]
    # A new timeline is numbered above every file there is, unusable ones included.
    assert tl.next_timeline(lineage, 5) == tl.Timeline(timeline=after, parent=1, forked_at=5)


def test_long_chains_resolve_without_recursion_in_linear_time() -> None:
    n = 20_000
    records = _records(*((k, k - 1, k) for k in range(1, n + 1)))
    lineage = tl.resolve(records, {})
    assert lineage.current == n and len(lineage.chain) == n + 1
    # The same chain, broken at its root: every timeline is ignored, each walked once.
    records[1] = tl.Timeline(timeline=1, parent=n + 1, forked_at=1)
    broken = tl.resolve(records, {})
    assert broken.current == 0 and len(broken.ignored) == n
    assert "ancestor timeline 20001 does not exist" in broken.ignored[n]
