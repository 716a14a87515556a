"""Reading and writing a root's TIMELINE files (``checkflow.timeline`` says what they mean).

Only this module and ``catalog`` read them; imports no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from checkflow import timeline as tl
from checkflow.storage import Storage

log = logging.getLogger(__name__)


def read_lineage(storage: Storage, names: Iterable[str]) -> tl.Lineage:
    """The lineage of the root whose entries are ``names`` (``storage.listdir()``): every
    TIMELINE file among them is read (within ``timeline.MAX_TIMELINE_BYTES``); one that
    cannot be used is logged and ignored (``Lineage.ignored`` says why)."""
    records: dict[int, tl.Timeline] = {}
    ignored: dict[int, str] = {}
    for name in names:
        k = tl.parse_timeline_file(name)
        if k is None:
            continue
        try:
            records[k] = tl.parse_timeline(_read_small(storage, name), k)
        except (tl.TimelineError, OSError) as e:
            ignored[k] = f"{name}: {e}"
    lineage = tl.resolve(records, ignored)
    for k, why in sorted(lineage.ignored.items()):
        log.warning("ignoring timeline %d of %s: %s", k, storage.uri, why)
    return lineage


def current_lineage(storage: Storage) -> tl.Lineage:
    """The lineage of ``storage`` (one listing and its TIMELINE files; no manifest read)."""
    return read_lineage(storage, storage.listdir())


def write_timeline(storage: Storage, record: tl.Timeline) -> None:
    """Store ``record`` as its TIMELINE file, atomically (``Storage.put``): readers see the
    whole record or none, so a crash while rolling back leaves the old lineage intact."""
    storage.put(tl.timeline_file(record.timeline), [record.to_json()])
    log.info(
        "timeline %d starts at step %d of timeline %d in %s",
        record.timeline,
        record.forked_at,
        record.parent,
        storage.uri,
    )


def _read_small(storage: Storage, name: str) -> bytes:
    """A TIMELINE file's bytes, refused on its stated size before any byte is read."""
    size = storage.size(name)
    if size > tl.MAX_TIMELINE_BYTES:
        raise tl.TimelineError(f"it is {size} bytes, over the {tl.MAX_TIMELINE_BYTES}-byte cap")
    return bytes(storage.read_at_most(name, size + 1))
