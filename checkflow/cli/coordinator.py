"""The CLI's calls to the coordinator's HTTP API: what ``status`` shows and the roll-back
of ``restore --coordinator``. Paths come from ``checkflow.protocol.paths`` and replies are
parsed into the protocol's models (``model_validate``), here and only here; the command
modules format what these functions return.

A URL may be a comma-separated list of replicas: the calls go through the rank client's
:class:`~checkflow.client.transport.Channel` (tried in order, sticking to the one that
answers, 307s followed within the list). A failure raises
:class:`~checkflow.cli.output.CliError`: exit 3 when no coordinator of the list answers or
they fail (the message names each URL tried), 4 when it does not know the job (HTTP 404), 2
when the list is bad or it refuses the request (a token or a step: 401, 403, 409, 422).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from checkflow.cli.output import (
    EXIT_NOT_FOUND,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    TOKEN_ON_COMMAND_LINE,
    CliError,
    warning,
)
from checkflow.client.endpoints import BadCoordinatorList
from checkflow.client.env import TOKEN, setting
from checkflow.client.transport import (
    Channel,
    CoordinatorUnavailable,
    token_sent,
    unauthorized_hint,
)
from checkflow.protocol import paths
from checkflow.protocol.messages import (
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
)

M = TypeVar("M", bound=BaseModel)

DEFAULT_URL = "http://127.0.0.1:8470"


@dataclass(frozen=True, slots=True)
class JobReport:
    """One job as ``checkflow status URL JOB`` shows it."""

    job: JobPublic
    ranks: list[RankPublic]
    checkpoints: list[CheckpointPublic]
    events: list[EventPublic]
    recoveries: list[EventPublic]
    """The ``generation_started`` and ``trained_again`` events of the newest recoveries
    (asked for by kind: the newest events may hold none of them)."""


URL = "CHECKFLOW_URL"
"""The coordinator of ``status`` and ``restore --coordinator`` when no URL is given."""


def coordinator_url(url: str | None) -> str:
    """``url``, else ``$CHECKFLOW_URL``, else the default local coordinator."""
    return setting(url, URL, os.environ, DEFAULT_URL) or DEFAULT_URL


def connect(url: str, token: str | None, token_file: str | None = None) -> Channel:
    """A client of the coordinator(s) at ``url`` (a comma-separated list). The token:
    ``token`` (a ``--token``: warned, deprecated), else the one in ``token_file``, else
    ``$CHECKFLOW_TOKEN``.

    Raises:
        CliError: ``url`` is not a valid list (exit 2).
    """
    if token is not None:
        warning(TOKEN_ON_COMMAND_LINE)
    if token is None and token_file is not None:
        token = read_token_file(token_file)
    return _http(url, setting(token, TOKEN, os.environ))


def read_token_file(path: str) -> str:
    """The token in the file at ``path`` (a mounted secret), its newline stripped.

    Raises:
        CliError: the file cannot be read or holds only whitespace (exit 2).
    """
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read the token file {path}: {e}; pass a readable file") from e
    if not token:
        raise CliError(f"the token file {path} is empty; write the coordinator's token in it")
    return token


def jobs(http: Channel) -> list[JobPublic]:
    """Every job the coordinator knows."""
    return _get(http, paths.path(paths.JOBS), JobList).jobs


MAX_EVENTS = 10_000
"""The most events one ``GET .../events`` returns."""
RECOVERY_EVENTS = ("generation_started", "trained_again")
"""The events a recovery is made of: its start and the moment the job trained again."""


def job_report(http: Channel, job: str, limit: int) -> JobReport:
    """One job with its ranks, its ``limit`` newest checkpoints and events, and the events
    of its ``limit`` newest recoveries."""
    newest = {"limit": limit}
    events = paths.path(paths.EVENTS, job=job)
    # Each recovery is at most two of these events: 2 * limit + 1 of them hold the starts
    # of the newest `limit` recoveries (the oldest one may be a lone trained_again).
    recoveries = {"limit": min(2 * limit + 1, MAX_EVENTS), "kind": list(RECOVERY_EVENTS)}
    return JobReport(
        job=_get(http, paths.path(paths.JOB, job=job), JobPublic),
        ranks=_get(http, paths.path(paths.RANKS, job=job), RankList).ranks,
        checkpoints=_get(
            http, paths.path(paths.CHECKPOINTS, job=job), CheckpointList, newest
        ).checkpoints,
        events=_get(http, events, EventList, newest).events,
        recoveries=_get(http, events, EventList, recoveries).events,
    )


def recover(http: Channel, job: str, step: int | None) -> RestorePoint:
    """Ask the coordinator to roll live job ``job`` back to committed ``step``.

    Running ranks are told to abort on their next heartbeat; the restarted group restores
    ``step`` (default: the newest committed checkpoint).

    Returns:
        The reply: the ``step`` restored (None: nothing committed) and the new ``generation``.
    """
    body = RecoverRequest(step=step).model_dump()
    return _parse(_send(http, "POST", paths.path(paths.RECOVER, job=job), body), RestorePoint)


# --- helpers ------------------------------------------------------------------------------
def _detail(r: httpx.Response) -> str:
    """The ``detail`` of a refusal; the start of the body when it is not the API's JSON
    (a proxy's page, another server)."""
    try:
        body = r.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return f"HTTP {r.status_code}: {r.text[:200]}"


TIMEOUT_S = 10.0
"""Each request's timeout; a command waits for each URL of its list in turn."""


def _http(url: str, token: str | None) -> Channel:
    try:
        urls = len(url.split(","))
        return Channel(url, token, TIMEOUT_S, budget_s=TIMEOUT_S * urls)
    except BadCoordinatorList as e:
        raise CliError(str(e), EXIT_USAGE) from None


def _get(http: Channel, path: str, model: type[M], params: dict[str, Any] | None = None) -> M:
    return _parse(_send(http, "GET", path, None, params), model)


def _parse(reply: Any, model: type[M]) -> M:
    """The reply as the protocol's ``model``; a reply of another shape is a clear error."""
    try:
        return model.model_validate(reply)
    except ValidationError as e:
        raise CliError(
            f"the coordinator's reply is not a {model.__name__} ({e.error_count()} problems, "
            f"first: {e.errors()[0]['msg']}); is it a checkflow coordinator of this version?",
            EXIT_UNAVAILABLE,
        ) from e


def _send(
    http: Channel,
    method: str,
    path: str,
    body: Any,
    params: dict[str, Any] | None = None,
) -> Any:
    try:
        r = http.send(method, path, body, params)
    except CoordinatorUnavailable as e:
        raise CliError(
            f"cannot reach the coordinator at {http.failover.coordinators} ({e}); is "
            "`checkflow serve` running there?",
            EXIT_UNAVAILABLE,
        ) from e
    where = http.failover.current  # the one that answered
    if r.status_code == 401:
        raise CliError(
            f"the coordinator refused: {unauthorized_hint(token_sent(r.request))}", EXIT_USAGE
        )
    if r.status_code == 404:  # the CLI asks only for jobs by name: the job is unknown
        raise CliError(
            f"{_detail(r)} on the coordinator at {where}; `checkflow status "
            f"{where}` lists the jobs it knows",
            EXIT_NOT_FOUND,
        )
    if r.status_code in (403, 409, 422):
        hint = " (see `checkflow status URL JOB`)" if r.status_code == 409 else ""
        raise CliError(f"{_detail(r)}{hint}", EXIT_USAGE)
    if r.status_code >= 400:
        code = EXIT_UNAVAILABLE if r.status_code >= 500 else EXIT_USAGE
        raise CliError(f"coordinator answered HTTP {r.status_code}: {r.text[:200]}", code)
    return r.json()
