"""Tunables with an environment override, and a context manager for tests (torchsnapshot-style).

CHECKFLOW_CHUNK_BYTES          largest encoded box of a tensor (default 64 MiB)
CHECKFLOW_PERSIST_NICE         added to the persist thread's nice value (default 0)
CHECKFLOW_DIRECT_IO            1 (default): local checkpoint files bypass the page cache
                               (O_DIRECT, see checkflow.storage.direct); 0: buffered writes
CHECKFLOW_MAX_MANIFEST_BYTES   largest manifest file a reader reads and parses (default 64 MiB);
                               a larger one is damage, refused before it is read
CHECKFLOW_S3_DELETE_MD5        1 (default): S3 batch deletes carry Content-MD5, which MinIO-family
                               servers require (checkflow.storage.s3compat); 0: they do not
CHECKFLOW_TEST_COMMIT_DELAY_S  fault injection: sleep between the rank manifest and the
                               commit, so a test can kill a process mid-persist
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

_DEFAULTS = {
    "CHECKFLOW_CHUNK_BYTES": str(64 << 20),
    "CHECKFLOW_TEST_COMMIT_DELAY_S": "0",
    # 0: the persist thread at the training thread's priority. At +10 it starved whenever
    # anything else ran on the node, checkpoints queued up and training waited for a host
    # buffer set; with direct writes a persist costs ~0.5 s CPU per GiB, little to give up.
    "CHECKFLOW_PERSIST_NICE": "0",
    "CHECKFLOW_READ_THREADS": "2",
    "CHECKFLOW_DIRECT_IO": "1",
    "CHECKFLOW_S3_DELETE_MD5": "1",
    # About 200,000 chunk entries of one rank; checkflow's own manifests are far smaller.
    "CHECKFLOW_MAX_MANIFEST_BYTES": str(64 << 20),
}


def _get(name: str) -> str:
    return os.environ.get(name, _DEFAULTS[name])


def _int(name: str) -> int:
    """The knob as an integer. The environment is input too: a value that is not one is
    refused with one line naming the variable, not a bare ``int()`` error.

    Raises:
        ValueError: it is not a whole number.
    """
    text = _get(name)
    try:
        return int(text)
    except ValueError:
        raise ValueError(
            f"{name}={text!r} is not a whole number; unset it for the default "
            f"({_DEFAULTS[name]}) or give one"
        ) from None


def chunk_bytes() -> int:
    return _int("CHECKFLOW_CHUNK_BYTES")


def max_manifest_bytes() -> int:
    """Largest manifest a reader accepts: it holds at most this many bytes of one."""
    return max(1, _int("CHECKFLOW_MAX_MANIFEST_BYTES"))


def read_threads() -> int:
    return max(1, _int("CHECKFLOW_READ_THREADS"))


def persist_nice() -> int:
    return _int("CHECKFLOW_PERSIST_NICE")


def direct_io() -> bool:
    return _get("CHECKFLOW_DIRECT_IO").strip().lower() not in ("0", "false", "no", "off", "")


def s3_delete_md5() -> bool:
    return _get("CHECKFLOW_S3_DELETE_MD5").strip().lower() not in ("0", "false", "no", "off", "")


def commit_delay_s() -> float:
    return float(_get("CHECKFLOW_TEST_COMMIT_DELAY_S"))


@contextmanager
def override(**values: object) -> Iterator[None]:
    """``with override(CHECKFLOW_CHUNK_BYTES=1024): ...`` sets knobs for the block."""
    old = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        if k not in _DEFAULTS:
            raise KeyError(f"unknown knob {k}; known: {sorted(_DEFAULTS)}")
        os.environ[k] = str(v)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
