"""The CLI's calls to the coordinator's HTTP API: what ``status`` shows and the roll-back
of ``restore --coordinator``. Replies are parsed here, and only here; the command modules
format what these functions return.

A failure raises :class:`~checkflow.cli.output.CliError`: exit 1 when the coordinator is
unreachable or refuses, 2 when it rejects the input (HTTP 422).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import httpx

from checkflow.cli.output import EXIT_FAILED, EXIT_USAGE, CliError

DEFAULT_URL = "http://127.0.0.1:8470"


@dataclass(frozen=True, slots=True)
class JobReport:
    """One job as ``checkflow status URL JOB`` shows it."""

    job: dict[str, Any]
    ranks: list[dict[str, Any]]
    checkpoints: list[dict[str, Any]]
    events: list[dict[str, Any]]


def coordinator_url(url: str | None) -> str:
    """``url``, else ``$CHECKFLOW_URL``, else the default local coordinator."""
    return url or os.environ.get("CHECKFLOW_URL") or DEFAULT_URL


def connect(url: str, token: str | None) -> httpx.Client:
    """An HTTP client of the coordinator at ``url`` (token: default ``$CHECKFLOW_TOKEN``)."""
    return _http(url, token or os.environ.get("CHECKFLOW_TOKEN"))


def jobs(http: httpx.Client) -> list[dict[str, Any]]:
    """Every job the coordinator knows."""
    result: list[dict[str, Any]] = _get(http, "/v1/jobs")["jobs"]
    return result


def job_report(http: httpx.Client, job: str, limit: int) -> JobReport:
    """One job with its ranks and its ``limit`` newest checkpoints and events."""
    return JobReport(
        job=_get(http, f"/v1/jobs/{job}"),
        ranks=_get(http, f"/v1/jobs/{job}/ranks")["ranks"],
        checkpoints=_get(http, f"/v1/jobs/{job}/checkpoints?limit={limit}")["checkpoints"],
        events=_get(http, f"/v1/jobs/{job}/events?limit={limit}")["events"],
    )


def recover(http: httpx.Client, job: str, step: int | None) -> dict[str, Any]:
    """Ask the coordinator to roll live job ``job`` back to committed ``step``.

    Running ranks are told to abort on their next heartbeat; the restarted group restores
    ``step`` (default: the newest committed checkpoint).

    Returns:
        The reply: the ``step`` restored (None: nothing committed) and the new ``generation``.
    """
    return _send(http, "POST", f"/v1/jobs/{job}/recover", {"step": step})


# --- helpers ------------------------------------------------------------------------------
def _http(url: str, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=10.0)


def _get(http: httpx.Client, path: str) -> dict[str, Any]:
    return _send(http, "GET", path, None)


def _send(http: httpx.Client, method: str, path: str, body: Any) -> dict[str, Any]:
    try:
        r = http.request(method, path, json=body)
    except httpx.TransportError as e:
        raise CliError(
            f"cannot reach the coordinator at {http.base_url}: {e}; is "
            "`checkflow serve` running there?",
            EXIT_FAILED,
        ) from e
    if r.status_code == 401:
        raise CliError(
            "the coordinator wants a token: pass --token or set CHECKFLOW_TOKEN", EXIT_FAILED
        )
    if r.status_code in (404, 409, 422):
        detail = r.json().get("detail")
        hint = " (see `checkflow status URL JOB`)" if r.status_code != 422 else ""
        raise CliError(f"{detail}{hint}", EXIT_USAGE if r.status_code == 422 else EXIT_FAILED)
    if r.status_code >= 400:
        raise CliError(f"coordinator answered HTTP {r.status_code}: {r.text[:200]}", EXIT_FAILED)
    result: dict[str, Any] = r.json()
    return result
