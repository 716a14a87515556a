"""Learn committed checkpoints from storage: the steps under ``<uri>`` with a MANIFEST.json.

The coordinator is not the source of truth for commits, storage is: after losing its
database, or for checkpoints committed while it was down, this listing fills the gap.
Runs in a worker thread (it is network I/O), never on the event loop.
"""

from __future__ import annotations

import logging

from checkflow.manifest import MANIFEST, parse_step_dir

logger = logging.getLogger(__name__)


def committed_steps(uri: str) -> list[int]:
    """Steps under ``uri`` whose ``MANIFEST.json`` exists; [] when storage can't be listed."""
    import fsspec  # imported here: only needed when a job names its storage

    try:
        fs, root = fsspec.core.url_to_fs(uri)
        paths = fs.glob(f"{root.rstrip('/')}/step-*/{MANIFEST}")
    except Exception as e:  # any backend error: the coordinator must keep serving
        logger.warning("cannot list checkpoints under %s: %s", uri, e)
        return []
    steps = (parse_step_dir(p.rsplit("/", 2)[-2]) for p in paths)
    return sorted(s for s in steps if s is not None)
