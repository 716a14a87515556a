"""One connection to the coordinator that speaks the protocol: a request is a model, and a
reply is parsed into the model the API documents for it."""

from __future__ import annotations

import logging
import threading
from typing import TypeVar

import httpx
from pydantic import BaseModel, ValidationError

logger = logging.getLogger("checkflow.client.rank")
Reply = TypeVar("Reply", bound=BaseModel)


class CoordinatorUnavailable(RuntimeError):
    """The coordinator could not be used: network error, timeout, 5xx, or a reply this
    client cannot read (a coordinator of an incompatible version)."""


class Channel:
    """A keep-alive HTTP connection to the coordinator, used by one caller at a time.

    Args:
        url: Base URL of the coordinator, e.g. ``http://coord:8470``.
        token: Bearer token of the coordinator, if it has one.
        timeout_s: Timeout of each request.
    """

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout_s)
        self._lock = threading.Lock()

    def call(self, method: str, path: str, body: BaseModel | None, reply: type[Reply]) -> Reply:
        """Send ``body`` (fields left at None are omitted; None: no body, as for a GET) and
        parse the answer as ``reply``.

        Raises:
            CoordinatorUnavailable: no answer, a 5xx, or an answer that is not a ``reply``.
            httpx.HTTPStatusError: the coordinator refused (4xx); see :func:`why`.
        """
        payload = None if body is None else body.model_dump(mode="json", exclude_none=True)
        try:
            with self._lock:
                response = self._http.request(method, path, json=payload)
        except httpx.TransportError as e:
            raise CoordinatorUnavailable(f"{type(e).__name__}: {e}") from e
        if response.status_code >= 500:
            raise CoordinatorUnavailable(f"HTTP {response.status_code}")
        response.raise_for_status()
        try:
            return reply.model_validate_json(response.content)
        except ValidationError as e:
            raise CoordinatorUnavailable(f"unreadable reply to {method} {path}: {e}") from e

    def tell(self, path: str, body: BaseModel, reply: type[BaseModel], what: str) -> None:
        """POST a report the rank can do without: a failure is one warning, never raised."""
        try:
            self.call("POST", path, body, reply)
        except (CoordinatorUnavailable, httpx.HTTPStatusError) as e:
            logger.warning("could not report %s: %s", what, e)

    def close(self) -> None:
        self._http.close()


class Reachability:
    """Whether a rank's coordinator answered last time: each change is logged once, so a
    coordinator that is down for long does not flood the training's log."""

    def __init__(self, url: str, rank: int) -> None:
        self.url, self.rank = url, rank
        self.down = False

    def lost(self, error: Exception, interval: int | None) -> None:
        if not self.down:
            self.down = True
            logger.warning(
                "coordinator %s unreachable (%s); rank %d keeps training%s and retries",
                self.url,
                error,
                self.rank,
                f" with interval {interval}" if interval is not None else "",
            )

    def back(self) -> None:
        if self.down:
            self.down = False
            logger.warning("coordinator %s reachable again (rank %d)", self.url, self.rank)


def why(error: httpx.HTTPStatusError) -> str:
    """The status and the coordinator's ``detail`` of a refused request; for a 401, what to
    do given whether this request carried a token (:func:`unauthorized_hint`)."""
    try:
        detail = error.response.json().get("detail")
    except ValueError:
        detail = error.response.text
    text = f"HTTP {error.response.status_code}: {detail}"
    if error.response.status_code == 401:
        text += f"; {unauthorized_hint(token_sent(error.request))}"
    return text


def token_sent(request: httpx.Request) -> bool:
    """True when ``request`` carried a bearer token."""
    return request.headers.get("Authorization", "").startswith("Bearer ")


def unauthorized_hint(sent: bool) -> str:
    """What to do about a 401, given whether a token was sent: a wrong token needs the right
    one, not a hint to pass a token that was passed."""
    if sent:
        return (
            "the token sent is not this coordinator's (nor a job token it issued): check the "
            "token=, --token-file or CHECKFLOW_TOKEN given (an argument wins over "
            "CHECKFLOW_TOKEN)"
        )
    return (
        "no token was sent and this coordinator wants one: pass --token-file PATH (token= "
        "to a Checkpointer) or set CHECKFLOW_TOKEN"
    )
