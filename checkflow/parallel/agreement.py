"""Cross-rank agreement through the job's c10d store, never through the training group.

At each checkpoint, on the training thread, every rank publishes a small record in the
job's c10d store (busy or not, its interval, a digest of what it holds) and reads
everyone's: all ranks then take or skip the checkpoint together, use rank 0's interval,
and compute the same write plan (``RankSync``). The commit counts finished ranks in the
store (``store.add``), so a rank that dies leaves the count short and the step
uncommitted, and nobody blocks (``StoreCommit``). A restore is agreed in the store as
well: every rank loads the same step, the newest one that every rank reads intact
(``RestoreAgreement``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch.distributed as dist

from checkflow.parallel import _compat
from checkflow.parallel.groups import rank_and_world
from checkflow.parallel.sharding import LocalState, balanced_writers
from checkflow.write.commit import CommitProtocol, RankResult

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Agreement:
    """What every rank decided together at one checkpoint."""

    go: bool
    """False when some rank is still persisting: every rank skips this checkpoint."""
    interval: int | None
    """Rank 0's checkpoint interval (``every="auto"``)."""
    writers: dict[str, int]
    """Writer rank of each replicated tensor."""


def _to_json(value: Any) -> bytes:
    # Records cross ranks through the store as JSON, never pickle: whoever can write to the
    # job's store must not be able to run code in every rank. Sorted keys: same bytes, same
    # digest on every rank.
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _from_json(data: bytes) -> Any:
    return json.loads(data)


class RankSync:
    """Cross-rank agreement of one ``Checkpointer`` through the job's c10d store.

    Construct it on every rank in the same order (it takes a generation number from the
    store, so several checkpointers in one job never read each other's keys). ``agree`` is
    called on the training thread by every rank at the same checkpoint; ``commit`` is the
    ``CommitProtocol`` used by the persist threads (store operations only, no collectives).
    """

    def __init__(self, group: Any, uri: str) -> None:
        self.rank, self.world_size = rank_and_world(group)
        key = hashlib.sha1(uri.encode()).hexdigest()[:12]
        base = _compat.default_store()
        root = dist.PrefixStore(f"checkflow/{key}/", base)
        generation = (root.add("generation", 1) - 1) // self.world_size
        self.store = dist.PrefixStore(f"g{generation}/", root)
        self.commit = StoreCommit(self.store, self.world_size)
        self.restore = RestoreAgreement(self.store, self.rank, self.world_size)
        self._round = 0
        self.interval: int | None = None
        """Rank 0's interval as of the last agreement (``every="auto"``)."""
        self._known: dict[str, dict[str, int]] = {}
        self._plans: dict[tuple[Any, ...], dict[str, int]] = {}
        self._decisions = 0
        self._decided: str | None = None

    def from_rank0(self, what: str, decide: Callable[[], Any]) -> Any:
        """Rank 0's ``decide()`` (a JSON value), returned on every rank, which all call this
        at the same point: one rank decides what all must agree on (a rollback's timeline).

        Raises:
            RuntimeError: on the other ranks when ``decide`` raised on rank 0 (which
                re-raises its own error), so that no rank waits for a value never sent.
        """
        self._decisions += 1
        key = f"rank0/{self._decisions}/{what}"
        if self.rank == 0 and self._decided is not None:
            # Each decision follows a restore, which the ranks make together (they agree on
            # its step): every rank has read the previous one. Only the newest stays, so the
            # store holds a bounded number of keys.
            self.store.delete_key(self._decided)
        self._decided = key if self.rank == 0 else None
        if self.rank != 0:
            reply = json.loads(self.store.get(key))
            if "error" in reply:
                raise RuntimeError(f"rank 0 could not {what}: {reply['error']}")
            return reply["value"]
        try:
            value = decide()
        except Exception as e:
            self.store.set(key, json.dumps({"error": f"{type(e).__name__}: {e}"}))
            raise
        self.store.set(key, json.dumps({"value": value}))
        return value

    def agree(self, *, busy: bool, interval: int | None, local: LocalState) -> Agreement:
        """Publish this rank's record for the next checkpoint and read every rank's."""
        self._round += 1
        holdings = local.holdings
        encoded = _to_json(holdings)
        digest = hashlib.sha1(encoded).hexdigest()[:16]
        if digest not in self._known:
            self.store.set(f"holdings/{digest}", encoded)  # type: ignore[arg-type]
            self._known[digest] = holdings
        record = [busy, interval, digest, local.shard_bytes]
        self.store.set(f"round/{self._round}/{self.rank}", _to_json(record))  # type: ignore[arg-type]
        records = [
            _from_json(self.store.get(f"round/{self._round}/{r}")) for r in range(self.world_size)
        ]
        if self._round > 2 and self.rank == 0:
            # Old rounds are read by everyone by now (each rank read them to get here).
            for r in range(self.world_size):
                self.store.delete_key(f"round/{self._round - 2}/{r}")
        digests = tuple(rec[2] for rec in records)
        shard_bytes = tuple(rec[3] for rec in records)
        plan_key = (digests, shard_bytes)
        if plan_key not in self._plans:
            self._plans = {plan_key: self._plan(digests, shard_bytes)}
        return Agreement(
            go=not any(rec[0] for rec in records),
            interval=records[0][1],
            writers=self._plans[plan_key],
        )

    def _plan(self, digests: tuple[str, ...], shard_bytes: tuple[int, ...]) -> dict[str, int]:
        holders: dict[str, list[int]] = {}
        sizes: dict[str, int] = {}
        for rank, digest in enumerate(digests):
            if digest not in self._known:
                self._known[digest] = _from_json(self.store.get(f"holdings/{digest}"))
            for fqn, nbytes in self._known[digest].items():
                holders.setdefault(fqn, []).append(rank)
                sizes[fqn] = nbytes
        return balanced_writers(holders, sizes, dict(enumerate(shard_bytes)))


class StoreCommit(CommitProtocol):
    """The last rank to finish a step commits it, counted in the c10d store.

    That rank also deletes the step's counter: every rank has added to it by then and none
    reads it again, so a long job keeps no key per checkpoint in the store. A step that never
    commits (a rank died) leaves its counter, under a generation nobody reuses.
    """

    def __init__(self, store: Any, world_size: int) -> None:
        self.store = store
        self.world_size = world_size

    def rank_persisted(self, step: int, rank: RankResult) -> bool:
        key = f"persisted/{step}"
        if self.store.add(key, 1) != self.world_size:
            return False
        self.store.delete_key(key)
        return True


T = TypeVar("T")


class _Candidates(Generic[T]):
    """This rank's reads of candidate steps: each step is read at most once, and only the
    newest successful read is held (a restore keeps one state in memory, not one per step)."""

    def __init__(self, steps: Iterable[int], read: Callable[[int], T | None]) -> None:
        self.steps = sorted(set(steps), reverse=True)
        self._read = read
        self._bad: set[int] = set()
        self.held: tuple[int, T] | None = None

    def readable(self, step: int) -> bool:
        if self.held is not None and self.held[0] == step:
            return True
        if step in self._bad or step not in self.steps:
            return False
        value = self._read(step)
        if value is None:
            self._bad.add(step)
            return False
        self.held = (step, value)
        return True

    def newest_readable(self, bound: float) -> int | None:
        return next((s for s in self.steps if s <= bound and self.readable(s)), None)


def newest_readable(steps: Iterable[int], read: Callable[[int], T | None]) -> tuple[int, T] | None:
    """One rank alone: the newest of ``steps`` that ``read`` returns, and what it returned."""
    candidates = _Candidates(steps, read)
    step = candidates.newest_readable(math.inf)
    return None if step is None else candidates.held


class RestoreAgreement:
    """Every rank restores the same step: the newest one that every rank reads intact.

    One rank's files of the newest step may be damaged while the others read theirs; if each
    rank fell back on its own, the job would resume from a mix of two steps. Instead, in
    rounds through the job's c10d store: every rank proposes the newest step (at or below a
    bound) whose part it reads; all take the smallest proposal; the ranks that proposed a
    newer one read that step too, and every rank reports whether it could. When all could, it
    is the step. Otherwise the bound drops below it and the next round starts. The result is
    the newest step every rank reads: no rank proposes below it, and any step above it fails
    on some rank.

    ``agree`` runs on the training thread of every rank at the same call (like
    ``RankSync.agree``). Values are JSON. The last rank to finish deletes the call's keys.
    """

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self._calls = 0

    def agree(self, steps: Iterable[int], read: Callable[[int], T | None]) -> tuple[int, T] | None:
        """The agreed step and this rank's read of it; None when some rank reads none of
        ``steps`` (every rank then starts from scratch).

        Args:
            steps: committed steps this rank may restore (newest first or in any order).
            read: reads this rank's part of a step; returns None when it cannot.
        """
        self._calls += 1
        prefix = f"restore/{self._calls}"
        candidates = _Candidates(steps, read)
        bound: float = math.inf
        rounds = 0
        while True:
            rounds += 1
            mine = candidates.newest_readable(bound)
            proposals = self._exchange(f"{prefix}/{rounds}/propose", -1 if mine is None else mine)
            agreed = min(proposals)
            if agreed < 0:
                self._clean_up(prefix, rounds)
                return None
            if all(self._exchange(f"{prefix}/{rounds}/ok", candidates.readable(agreed))):
                break
            bound = agreed - 1
        self._clean_up(prefix, rounds)
        if mine != agreed:
            log.warning(
                "step %s cannot be restored on every rank; restoring step %d, the newest step "
                "that every rank reads",
                mine,
                agreed,
            )
        assert candidates.held is not None and candidates.held[0] == agreed
        return candidates.held

    def _exchange(self, name: str, value: Any) -> list[Any]:
        """Publish ``value`` as this rank's ``name``; every rank's value, by rank."""
        self.store.set(f"{name}/{self.rank}", json.dumps(value))
        return [json.loads(self.store.get(f"{name}/{r}")) for r in range(self.world_size)]

    def _clean_up(self, prefix: str, rounds: int) -> None:
        # Each rank counts itself out once it has read all it needs; the last one deletes
        # (deleting a key that a final round never wrote is a no-op).
        if self.store.add(f"{prefix}/done", 1) != self.world_size:
            return
        for n in range(1, rounds + 1):
            for kind in ("propose", "ok"):
                for r in range(self.world_size):
                    self.store.delete_key(f"{prefix}/{n}/{kind}/{r}")
        self.store.delete_key(f"{prefix}/done")


def restore_point(
    steps: Iterable[int], read: Callable[[int], T | None], sync: RankSync | None
) -> tuple[int, T] | None:
    """The step to restore and this rank's read of it: the newest one that reads, agreed by
    every rank when there are several (``RestoreAgreement``); None when none reads."""
    if sync is None:
        return newest_readable(steps, read)
    return sync.restore.agree(steps, read)
