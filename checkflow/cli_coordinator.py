"""The coordinator's subcommands of ``checkflow``: ``serve``, ``status``, and the
``restore --coordinator`` roll-back. ``checkflow.cli`` builds the parser and calls these.

Exit codes: 0 ok, 1 failed (coordinator unreachable or refused), 2 bad usage or input.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from checkflow.protocol import (
    CheckpointList,
    CheckpointPublic,
    EventList,
    EventPublic,
    JobList,
    JobPublic,
    RankList,
    RankPublic,
    RecoverRequest,
    RestorePoint,
    paths,
)

Reply = TypeVar("Reply", bound=BaseModel)

DEFAULT_URL = "http://127.0.0.1:8470"


def add_serve_parser(subparsers: Any) -> None:
    """Add ``serve``: run the coordinator on uvicorn (options override CHECKFLOW_* vars)."""
    p = subparsers.add_parser(
        "serve",
        help="run the coordinator service",
        description="Run the coordinator. Every option also reads CHECKFLOW_<OPTION>.",
    )
    p.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="TCP port (default 8470)")
    p.add_argument("--db", help="SQLite database (default: ~/.local/share/checkflow/...)")
    p.add_argument("--token", help="bearer token required on /v1 (default: none)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=serve)


def add_status_parser(subparsers: Any) -> None:
    """Add ``status [URL] [JOB]``: tables of jobs, or of one job's ranks/checkpoints/events."""
    p = subparsers.add_parser("status", help="show jobs, ranks, checkpoints and events")
    p.add_argument(
        "url",
        nargs="?",
        default=None,
        help=f"coordinator URL (default $CHECKFLOW_URL or {DEFAULT_URL})",
    )
    p.add_argument("job", nargs="?", help="job name: show its ranks, checkpoints and events")
    p.add_argument("--token", help="bearer token (default $CHECKFLOW_TOKEN)")
    p.add_argument("--limit", type=int, default=10, help="checkpoints and events to show")
    p.set_defaults(func=status)


def serve(args: argparse.Namespace) -> int:
    """Run the coordinator until interrupted."""
    import logging

    import pydantic
    import uvicorn
    from checkflow_server.app import create_app
    from checkflow_server.settings import Settings

    given = {k: getattr(args, k, None) for k in ("host", "port", "db", "token", "log_level")}
    try:
        settings = Settings(**{k: v for k, v in given.items() if v is not None})
    except pydantic.ValidationError as e:
        print(f"checkflow serve: bad setting: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
        app = create_app(settings)
    except Exception as e:  # e.g. unreadable database: say what, not a traceback
        print(f"checkflow serve: cannot open {settings.db}: {e}", file=sys.stderr)
        return 1
    print(
        f"checkflow coordinator on http://{settings.host}:{settings.port} (db {settings.db}"
        f"{', token required' if settings.token else ', no token'})",
        flush=True,
    )
    # One worker: the state lives in this process. uvloop + httptools measured 1.6-2x the
    # throughput of asyncio + h11 for heartbeats.
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        workers=1,
        loop=_pick("uvloop", "auto"),
        http=_pick("httptools", "auto"),
        log_level=settings.log_level,
        access_log=False,
    )
    server = uvicorn.Server(config)
    server.run()
    return 0 if server.started else 1


def status(args: argparse.Namespace) -> int:
    """Print tables of the coordinator's jobs, or of one job."""
    if args.url and "://" not in args.url and args.job is None:
        args.url, args.job = None, args.url  # `checkflow status JOB`: the URL was left out
    url = args.url or os.environ.get("CHECKFLOW_URL") or DEFAULT_URL
    token = args.token or os.environ.get("CHECKFLOW_TOKEN")
    try:
        with _http(url, token) as http:
            if not args.job:
                _print_jobs(_get(http, paths.path(paths.JOBS), JobList).jobs)
                return 0
            name, limit = args.job, f"?limit={args.limit}"
            job = _get(http, paths.path(paths.JOB, job=name), JobPublic)
            ranks = _get(http, paths.path(paths.RANKS, job=name), RankList).ranks
            cks = _get(http, paths.path(paths.CHECKPOINTS, job=name) + limit, CheckpointList)
            events = _get(http, paths.path(paths.EVENTS, job=name) + limit, EventList).events
    except _CliError as e:
        print(f"checkflow status: {e}", file=sys.stderr)
        return e.code
    _print_jobs([job])
    print()
    _print_ranks(ranks)
    print()
    _print_checkpoints(cks.checkpoints)
    print()
    _print_events(events)
    return 0


def roll_back(url: str, job: str, step: int | None, token: str | None) -> int:
    """Ask the coordinator to roll live job ``job`` back to committed ``step``.

    Running ranks are told to abort on their next heartbeat; the restarted group restores
    ``step`` (default: the newest committed checkpoint).

    Returns:
        The exit code: 0 done, 1 refused or unreachable, 2 bad input.
    """
    if step is not None and step < 0:
        print(f"checkflow restore: step must be >= 0, got {step}", file=sys.stderr)
        return 2
    token = token or os.environ.get("CHECKFLOW_TOKEN")
    try:
        with _http(url, token) as http:
            path = paths.path(paths.RECOVER, job=job)
            reply = _send(http, "POST", path, RecoverRequest(step=step), RestorePoint)
    except _CliError as e:
        print(f"checkflow restore: {e}", file=sys.stderr)
        return e.code
    target = reply.step
    where = f"step {target}" if target is not None else "the beginning (nothing committed)"
    print(
        f"job {job} rolled back to {where}: generation {reply.generation}; running "
        "ranks abort on their next heartbeat and the restarted group restores from there"
    )
    return 0


# --- helpers ------------------------------------------------------------------------------
class _CliError(Exception):
    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _pick(module: str, fallback: str) -> str:
    import importlib.util

    return module if importlib.util.find_spec(module) is not None else fallback


def _http(url: str, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=10.0)


def _get(http: httpx.Client, path: str, reply: type[Reply]) -> Reply:
    return _send(http, "GET", path, None, reply)


def _send(
    http: httpx.Client, method: str, path: str, body: BaseModel | None, reply: type[Reply]
) -> Reply:
    """The coordinator's answer to one request, parsed as ``reply``."""
    payload = None if body is None else body.model_dump(mode="json", exclude_none=True)
    try:
        r = http.request(method, path, json=payload)
    except httpx.TransportError as e:
        raise _CliError(
            f"cannot reach the coordinator at {http.base_url}: {e}; is "
            "`checkflow serve` running there?"
        ) from e
    if r.status_code == 401:
        raise _CliError("the coordinator wants a token: pass --token or set CHECKFLOW_TOKEN")
    if r.status_code in (404, 409, 422):
        detail = r.json().get("detail")
        hint = " (see `checkflow status URL JOB`)" if r.status_code != 422 else ""
        raise _CliError(f"{detail}{hint}", code=2 if r.status_code == 422 else 1)
    if r.status_code >= 400:
        raise _CliError(f"coordinator answered HTTP {r.status_code}: {r.text[:200]}")
    try:
        return reply.model_validate_json(r.content)
    except ValidationError as e:
        raise _CliError(
            f"the coordinator at {http.base_url} sent a reply this checkflow cannot read "
            f"(another version?): {e}"
        ) from e


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip())
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _when(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _ago(t: float | None) -> str:
    return "-" if t is None else f"{max(0.0, time.time() - t):.1f}s ago"


def _print_jobs(jobs: list[JobPublic]) -> None:
    if not jobs:
        print("no jobs")
        return
    _table(
        ["JOB", "WORLD", "ALIVE", "GEN", "INTERVAL", "NEXT CKPT", "RESTORE", "FAILURES"],
        [
            [
                j.name,
                j.world_size,
                j.ranks_alive,
                j.generation,
                j.interval,
                j.next_checkpoint_step,
                j.restore_step,
                j.failures,
            ]
            for j in jobs
        ],
    )


def _print_ranks(ranks: list[RankPublic]) -> None:
    _table(
        ["RANK", "STATE", "ALIVE", "GEN", "STEP", "LAST HEARTBEAT", "ITER S", "STALL S", "NODE"],
        [
            [
                r.rank,
                r.state,
                "yes" if r.alive else "no",
                r.generation,
                r.step,
                _ago(r.last_heartbeat),
                r.iteration_s,
                r.stall_s,
                r.node,
            ]
            for r in ranks
        ],
    )


def _print_checkpoints(cks: list[CheckpointPublic]) -> None:
    if not cks:
        print("no checkpoints")
        return
    _table(
        ["STEP", "STATUS", "GEN", "RANKS", "BYTES", "COMMITTED"],
        [
            [
                c.step,
                c.status,
                c.generation,
                f"{c.persisted_ranks}/{c.world_size}",
                c.nbytes,
                _when(c.committed_at),
            ]
            for c in cks
        ],
    )


def _print_events(events: list[EventPublic]) -> None:
    if not events:
        print("no events")
        return
    _table(
        ["TIME", "EVENT", "GEN", "RANK", "DETAIL"],
        [
            [
                _when(e.time),
                e.kind,
                e.generation,
                e.rank,
                ", ".join(f"{k}={_cell(v)}" for k, v in e.detail.items()),
            ]
            for e in events
        ],
    )
