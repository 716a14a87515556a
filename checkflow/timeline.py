"""Rollback timelines: which step folders make up the current run. Pure; no I/O.

A restore to a step older than the newest committed one (by the API, by a fallback past a
damaged step, or by the coordinator's rollback) starts a new *timeline*: rank 0 writes
``TIMELINE-<K>.json`` at the root, ``{"timeline": K, "parent": P, "forked_at": S}``, and
the steps taken from then on go to folders of their own, ``step-000000002.tK``. A
committed step folder is never written again, so no kill can leave a step that mixes two
timelines; and nothing is moved or deleted at the rollback, so a crash during it loses
nothing. Timeline 0 (every root's first, with no file) keeps the plain names.

Readers follow the *lineage*: the highest timeline whose parent chain is sound, then its
parent up to the step it forked at, and so on to timeline 0. "Newest" is the newest step
of the lineage, as Orbax and DCP users expect of "the newest checkpoint"; the steps of the
other timelines are *abandoned*: never restored, listed by ``ls --all``, deletable by gc.
A TIMELINE file that does not parse, whose parent is missing or that closes a cycle is
reported and ignored, with the timelines that descend from it: it never bricks the root.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from checkflow import manifest_json
from checkflow.manifest import StepFolder

TIMELINE_PREFIX = "TIMELINE-"
MAX_TIMELINE_BYTES = 4096
"""Largest TIMELINE file read; checkflow writes about 50 bytes."""
_FILE_RE = re.compile(r"^TIMELINE-([1-9][0-9]*)\.json$")
_TYPES = {"timeline": "int", "parent": "int", "forked_at": "int"}


class TimelineError(ValueError):
    """A TIMELINE file that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class Timeline:
    """One rollback: timeline ``timeline`` continues ``parent`` after step ``forked_at``
    (-1: from scratch, when no step could be restored)."""

    timeline: int
    parent: int
    forked_at: int

    def to_json(self) -> bytes:
        fields = {"timeline": self.timeline, "parent": self.parent, "forked_at": self.forked_at}
        return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()


def timeline_file(timeline: int) -> str:
    """``TIMELINE-3.json``: the record of timeline 3 (timeline 0 has none)."""
    if timeline < 1:
        raise ValueError(f"timeline {timeline} has no file; timelines of rollbacks start at 1")
    return f"{TIMELINE_PREFIX}{timeline}.json"


def parse_timeline_file(name: str) -> int | None:
    """The timeline a root entry's name is the record of; None when it is not one. Only
    the names :func:`timeline_file` writes parse (no leading zero, ASCII digits)."""
    m = _FILE_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def parse_timeline(data: bytes | bytearray, timeline: int) -> Timeline:
    """The record in ``TIMELINE-<timeline>.json``.

    Raises:
        TimelineError: too large, not JSON, a field missing or of the wrong type, a number
            out of range, or a ``timeline`` field other than the file's name says.
    """
    if len(data) > MAX_TIMELINE_BYTES:
        raise TimelineError(f"it is {len(data)} bytes, over the {MAX_TIMELINE_BYTES}-byte cap")
    try:
        raw = manifest_json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise TimelineError(f"it is not valid JSON ({e})") from None
    if not isinstance(raw, dict) or set(raw) != set(_TYPES):
        raise TimelineError(f"it must be a JSON object with exactly the fields {sorted(_TYPES)}")
    try:
        manifest_json.check_types(raw, _TYPES)
    except ValueError as e:
        raise TimelineError(str(e)) from None
    found = Timeline(**raw)
    if found.timeline != timeline:
        raise TimelineError(f"it says timeline {found.timeline}, its name timeline {timeline}")
    if found.parent < 0 or found.parent == timeline or found.forked_at < -1:
        raise TimelineError(f"parent {found.parent} / forked_at {found.forked_at} are out of range")
    return found


@dataclass(frozen=True, slots=True)
class Lineage:
    """The current timeline and the steps each timeline of its chain contributes."""

    current: int = 0
    """The timeline new checkpoints are written to."""
    chain: tuple[tuple[int, float], ...] = ((0, math.inf),)
    """``(timeline, last step it contributes)``, from ``current`` up to timeline 0."""
    ignored: dict[int, str] = field(default_factory=dict)
    """TIMELINE files that were not used, by timeline: why."""
    highest: int = 0
    """The highest timeline named by any TIMELINE file, used or not: a new one is above it."""

    def owner(self, step: int) -> tuple[int, ...]:
        """The timelines whose folder of ``step`` is on the lineage, in order of preference."""
        return tuple(t for t, last in self.chain if step <= last)

    def pick(self, folders: Iterable[StepFolder]) -> tuple[dict[int, StepFolder], list[StepFolder]]:
        """Split step folders into the lineage's, one per step (``{step: folder}``), and the
        abandoned ones (oldest first): for each step, the folder of the first timeline of
        the chain that contributes it."""
        rank = {t: i for i, (t, _) in enumerate(self.chain)}
        on: dict[int, StepFolder] = {}
        off: list[StepFolder] = []
        for f in sorted(folders, key=lambda f: (f.step, rank.get(f.timeline, len(rank)))):
            usable = f.timeline in self.owner(f.step)
            if usable and f.step not in on:
                on[f.step] = f
            else:
                off.append(f)
        return dict(sorted(on.items())), off


def resolve(records: Mapping[int, Timeline], ignored: Mapping[int, str]) -> Lineage:
    """The lineage of a root whose TIMELINE files parsed into ``records`` (and those in
    ``ignored`` did not): the highest timeline whose parent chain reaches timeline 0
    through readable records without a cycle. Iterative, and linear in the records: a
    broken chain marks every timeline on it, which is then not walked again."""
    bad = dict(ignored)
    highest = max([*records, *ignored], default=0)
    for k in sorted(records, reverse=True):
        if k in bad:
            continue
        chain, why = _chain(k, records, bad)
        if why is None:
            return Lineage(current=k, chain=chain, ignored=bad, highest=highest)
        for t, _ in chain:  # each of them reaches the same break
            bad.setdefault(t, why)
    return Lineage(ignored=bad, highest=highest)


def _chain(
    k: int, records: Mapping[int, Timeline], bad: Mapping[int, str]
) -> tuple[tuple[tuple[int, float], ...], str | None]:
    """``(timeline, last step)`` from ``k`` up; with why it breaks (then the chain is the
    part walked), or None."""
    chain: list[tuple[int, float]] = []
    seen: set[int] = set()
    last: float = math.inf
    while k != 0:
        if k in seen:
            return tuple(chain), f"its parents form a cycle through timeline {k}"
        if k not in records or k in bad:
            why = "is unusable" if k in bad else "does not exist"
            return tuple(chain), f"its ancestor timeline {k} {why}"
        seen.add(k)
        chain.append((k, last))
        last = min(last, records[k].forked_at)
        k = records[k].parent
    chain.append((0, last))
    return tuple(chain), None


def next_timeline(lineage: Lineage, forked_at: int) -> Timeline:
    """The record of a rollback to ``forked_at`` from the current timeline: numbered above
    every TIMELINE file there is (an unreadable one too: its name is never reused)."""
    return Timeline(timeline=lineage.highest + 1, parent=lineage.current, forked_at=forked_at)
