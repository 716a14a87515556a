"""Who commits a step, and the write that commits it.

A step is visible to readers only once its ``MANIFEST.json`` is stored, and that happens only
after every rank's manifest is. A ``CommitProtocol`` picks the one rank that writes it:
``SingleProcessCommit`` for one process, ``CoordinatorCommit`` through the coordinator
(falling back to a local protocol while it is down) and, across ranks without a
coordinator, ``StoreCommit`` in ``checkflow.parallel.agreement`` (the c10d store).
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

from checkflow import manifest as mf
from checkflow.protocol import RetentionReport
from checkflow.storage import Storage

log = logging.getLogger(__name__)


class CommitProtocol(ABC):
    """Decides which rank writes a step's ``MANIFEST.json``.

    Every rank's persist thread calls ``rank_persisted`` once per step, in step order, after
    its rank manifest is stored. Exactly one rank gets True, and only once every rank of the
    step has called it; that rank writes the global manifest.
    """

    @abstractmethod
    def rank_persisted(self, step: int, rank: RankResult) -> bool:
        """Record that ``rank`` stored its part of ``step``; True means: commit it now."""

    def retention_done(self, step: int, failed: int, error: str, *, permanent: bool) -> None:
        """The committing rank's retention after ``step`` left ``failed`` old steps (0: it
        works again after failing), because of ``error``. Called on the persist thread;
        without a coordinator there is no one to tell (``stats`` and the log say it)."""
        return None


class SingleProcessCommit(CommitProtocol):
    """One process: its rank is the only one, so it always commits."""

    def rank_persisted(self, step: int, rank: RankResult) -> bool:
        return True


@dataclass(slots=True)
class RankResult:
    """What one rank's persist of one step stored, handed to the commit protocol."""

    step: int
    rank: int
    manifest_path: str
    nbytes: int
    duration_s: float
    committed: bool = False
    """True on the rank that wrote the global manifest."""
    kind: str = "full"
    """``delta`` when some chunk of this part depends on an older step."""


def write_commit(
    storage: Storage, step: int, world_size: int, *, meta: dict[str, Any], folder: str | None = None
) -> mf.GlobalManifest:
    """Write ``MANIFEST.json`` for ``step`` (in ``folder``, by default its timeline-0 one)
    once every rank manifest is stored.

    Raises:
        RuntimeError: a rank manifest is missing (the step must stay uncommitted).
    """
    folder = folder or mf.step_dir(step)
    names = [mf.rank_manifest_name(r) for r in range(world_size)]
    ranks = [
        mf.RankManifest.from_json(storage.read(f"{folder}/{n}"), where=storage.url(f"{folder}/{n}"))
        for n in names
    ]
    bases = sorted(set().union(*(r.base_steps for r in ranks)))
    manifest = mf.GlobalManifest(
        step=step,
        world_size=world_size,
        created=time.time(),
        kind="delta" if bases else "full",
        base_steps=bases,
        nbytes=sum(r.nbytes for r in ranks),
        ranks=names,
        meta=meta,
    )
    storage.put(f"{folder}/{mf.MANIFEST}", [manifest.to_json()])
    log.info("committed step %d (%s, %d bytes)", step, manifest.kind, manifest.nbytes)
    return manifest


class PersistReporter(Protocol):
    """The part of the coordinator client a commit needs (``CoordinatorClient``)."""

    def report_persisted(
        self,
        step: int,
        nbytes: int,
        duration_s: float,
        manifest_path: str,
        tier: str = ...,
        kind: str | None = ...,
        jit: bool = ...,
    ) -> bool | None:
        """True: this rank commits; False: another does; None: no answer (coordinator down).
        ``tier`` ``"ram"``: the part is in node memory (``checkflow.memory``); ``jit``: a
        just-in-time copy that stands for every rank (``checkflow.memory.jit``)."""

    @property
    def generation(self) -> int | None:
        """The rank's generation; None before it registered."""

    def report_retention(self, report: RetentionReport) -> None:
        """Retention after a commit failed, or works again; never raises."""


class CoordinatorCommit(CommitProtocol):
    """Asks the coordinator which rank commits; falls back to ``local`` when it is down.

    Args:
        client: reports this rank's persist to the coordinator.
        local: decides instead while the coordinator does not answer, so that a
            coordinator outage never leaves a step uncommitted.
    """

    def __init__(self, client: PersistReporter, local: CommitProtocol) -> None:
        self.client = client
        self.local = local

    def rank_persisted(self, step: int, rank: RankResult) -> bool:
        answer = self.client.report_persisted(
            step, rank.nbytes, rank.duration_s, rank.manifest_path, kind=rank.kind
        )
        if answer is None:
            return self.local.rank_persisted(step, rank)
        return bool(answer)

    def retention_done(self, step: int, failed: int, error: str, *, permanent: bool) -> None:
        generation = self.client.generation
        if generation is None:
            return
        report = RetentionReport(
            generation=generation, step=step, failed=failed, permanent=permanent, error=error[:1024]
        )
        self.client.report_retention(report)


def commit_protocol(ranks: CommitProtocol | None, client: PersistReporter | None) -> CommitProtocol:
    """Who commits: the coordinator when there is one (``ranks`` or a single process as
    its fallback), else the cross-rank protocol ``ranks``, else this single process."""
    local = ranks if ranks is not None else SingleProcessCommit()
    return CoordinatorCommit(client, local) if client is not None else local
