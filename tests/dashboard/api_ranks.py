"""The ranks of one job, driven through the coordinator's HTTP API with the protocol's
models, sending what real ranks send (register, heartbeat, persisted parts, commit) and
what a launcher sends when a process dies. The dashboard tests use them to change a job
while a browser watches it."""

from __future__ import annotations

import httpx

from checkflow.protocol import (
    CheckpointKind,
    CheckpointPublic,
    CommitReport,
    FailureReport,
    FinishRequest,
    Heartbeat,
    HeartbeatReply,
    PartReply,
    PartReport,
    RegisterRequest,
    Registration,
    StopReason,
    StopRequest,
    paths,
)


class ApiRanks:
    """Ranks ``0..world-1`` of ``job``, all in one generation."""

    def __init__(self, http: httpx.Client, job: str, world: int) -> None:
        self.http, self.job, self.world = http, job, world
        self.generation = 0

    def register(self) -> Registration:
        """Every rank registers (again), as a restarted group does; returns the last reply."""
        for rank in range(self.world):
            path = paths.path(paths.REGISTER, job=self.job, rank=rank)
            reply = Registration.model_validate(self._send("POST", path, RegisterRequest()))
        self.generation = reply.generation
        return reply

    def heartbeat(
        self, step: int, iteration_s: float | None = None, stall_s: float | None = None
    ) -> HeartbeatReply:
        """Every rank reports ``step`` and, optionally, its step time and snapshot stall."""
        for rank in range(self.world):
            body = Heartbeat(
                generation=self.generation,
                step=step,
                iteration_s=iteration_s,
                stall_s=stall_s,
                persist_s=None if stall_s is None else 4 * stall_s,
            )
            path = paths.path(paths.RANK_HEARTBEAT, job=self.job, rank=rank)
            reply = HeartbeatReply.model_validate(self._send("POST", path, body))
        return reply

    def persist(
        self, step: int, nbytes: int, ranks: range | None = None, kind: str = "full"
    ) -> list[PartReply]:
        """``ranks`` (default all) report their ``kind`` part of checkpoint ``step`` persisted."""
        replies = []
        for rank in ranks if ranks is not None else range(self.world):
            body = PartReport(
                generation=self.generation,
                nbytes=nbytes,
                duration_s=0.5,
                manifest_path=f"step-{step:09d}/rank-{rank:05d}.json",
                kind=CheckpointKind(kind),
            )
            path = paths.path(paths.PART, job=self.job, step=step, rank=rank)
            replies.append(PartReply.model_validate(self._send("PUT", path, body)))
        return replies

    def checkpoint(
        self, step: int, nbytes: int, ranks: range | None = None, kind: str = "full"
    ) -> CheckpointPublic:
        """``ranks`` (default all; the others did earlier) persist their part of ``step``,
        then the rank told to commit commits."""
        ranks = ranks if ranks is not None else range(self.world)
        replies = self.persist(step, nbytes, ranks, kind)
        committer = next(r for r, p in zip(ranks, replies, strict=True) if p.must_commit)
        path = paths.path(paths.COMMIT, job=self.job, step=step)
        reply = self._send("POST", path, CommitReport(rank=committer, generation=self.generation))
        return CheckpointPublic.model_validate(reply)

    def crash(self, rank: int, seconds_ago: float) -> None:
        """A launcher reports that ``rank``'s process exited ``seconds_ago``."""
        body = FailureReport(generation=self.generation, exit_code=-9, seconds_ago=seconds_ago)
        self._send("POST", paths.path(paths.FAILURE, job=self.job, rank=rank), body)

    def finish(self, step: int) -> None:
        """Every rank ends training normally at ``step`` (what ``Checkpointer.close`` sends)."""
        for rank in range(self.world):
            body = FinishRequest(generation=self.generation, step=step)
            self._send("POST", paths.path(paths.FINISH, job=self.job, rank=rank), body)

    def stop(self, reason: StopReason) -> None:
        """The launcher stops the job (Ctrl-C: ``interrupted``; out of restarts: ``gave_up``)."""
        body = StopRequest(generation=self.generation, reason=reason)
        self._send("POST", paths.path(paths.STOP, job=self.job), body)

    def _send(self, method: str, path: str, body: object) -> object:
        assert hasattr(body, "model_dump")
        r = self.http.request(method, path, json=body.model_dump(mode="json"))
        assert r.is_success, f"{method} {path}: {r.status_code} {r.text}"
        return r.json()
