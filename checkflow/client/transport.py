"""One connection to the coordinator that speaks the protocol: a request is a model, and a
reply is parsed into the model the API documents for it."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from checkflow.client import endpoints
from checkflow.client.endpoints import Failover, RedirectRefused

logger = logging.getLogger("checkflow.client.rank")
Reply = TypeVar("Reply", bound=BaseModel)


class CoordinatorUnavailable(RuntimeError):
    """The coordinator could not be used: network error, timeout, 5xx, or a reply this
    client cannot read (a coordinator of an incompatible version). With several URLs, none
    of them could; the message names each one tried and what it did."""


MAX_REDIRECTS = 4
"""307s followed for one request: a replica points at the job's owner, once."""


class Channel:
    """A keep-alive HTTP connection to the coordinator, used by one caller at a time.

    Several URLs (a comma-separated list, or a :class:`Failover` shared with another
    channel) are tried in the failover's order within one budget: each request goes to the
    one that answered last, and on a transport error, a timeout or a 5xx to the next,
    while the budget lasts. So a caller never blocks longer than with one URL: the first
    try gets the whole ``timeout_s``, a later one what is left of ``budget_s``; a URL not
    tried in time is tried first by the next request. A 307/308 is followed with its
    method, body and token, but only to a listed origin (:func:`endpoints.redirect_target`).

    Args:
        url: Base URL(s) of the coordinator, e.g. ``http://coord:8470`` or
            ``http://a:8470,http://b:8470``; or a :class:`Failover`.
        token: Bearer token of the coordinator, if it has one.
        timeout_s: Timeout of each request.
        budget_s: Time for one call over the whole list (default ``timeout_s``).

    Raises:
        BadCoordinatorList: ``url`` is not a valid list (a ``ValueError``).
    """

    def __init__(
        self,
        url: str | Failover,
        token: str | None,
        timeout_s: float,
        budget_s: float | None = None,
    ) -> None:
        self.failover = url if isinstance(url, Failover) else Failover(endpoints.parse(url))
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(timeout=timeout_s, follow_redirects=False)
        self._timeout_s = timeout_s
        self._budget_s = timeout_s if budget_s is None else budget_s
        self._lock = threading.Lock()

    @property
    def headers(self) -> dict[str, str]:
        """The headers every request carries (the bearer token, when there is one)."""
        return dict(self._headers)

    def call(self, method: str, path: str, body: BaseModel | None, reply: type[Reply]) -> Reply:
        """Send ``body`` (fields left at None are omitted; None: no body, as for a GET) and
        parse the answer as ``reply``.

        Raises:
            CoordinatorUnavailable: no answer, a 5xx, or an answer that is not a ``reply``.
            httpx.HTTPStatusError: the coordinator refused (4xx); see :func:`why`.
        """
        payload = None if body is None else body.model_dump(mode="json", exclude_none=True)
        response = self.send(method, path, payload)
        response.raise_for_status()
        try:
            return reply.model_validate_json(response.content)
        except ValidationError as e:
            raise CoordinatorUnavailable(f"unreadable reply to {method} {path}: {e}") from e

    def send(
        self, method: str, path: str, payload: Any, params: dict[str, Any] | None = None
    ) -> httpx.Response:
        """The first answer below 500 from the URLs in the failover's order.

        Raises:
            CoordinatorUnavailable: none answered in the budget; names each URL and why.
        """
        deadline = time.monotonic() + self._budget_s
        tried: list[str] = []
        for base in self.failover.order():
            left = deadline - time.monotonic()
            if tried and left <= 0:
                tried.append(f"{base}: not tried (the {self._budget_s:g} s budget was spent)")
                continue
            try:
                response = self._follow(method, base + path, payload, params, deadline)
            except (httpx.RequestError, httpx.InvalidURL, RedirectRefused) as e:
                # RequestError: transport errors, and a body that does not decode;
                # InvalidURL: a Location of control characters or megabytes.
                tried.append(f"{base}: {type(e).__name__}: {e}")
            else:
                if response.status_code < 500:
                    self.failover.answered(str(response.url))
                    return response
                tried.append(f"{base}: HTTP {response.status_code}")
            self.failover.failed(base)
        raise CoordinatorUnavailable("; ".join(tried))

    def _follow(
        self,
        method: str,
        url: str,
        payload: Any,
        params: dict[str, Any] | None,
        deadline: float,
    ) -> httpx.Response:
        for _ in range(MAX_REDIRECTS + 1):
            timeout = max(0.05, min(self._timeout_s, deadline - time.monotonic()))
            with self._lock:
                response = self._http.request(
                    method,
                    url,
                    json=payload,
                    params=params,
                    headers=self._headers,
                    timeout=timeout,
                )
            if not 300 <= response.status_code < 400:
                return response
            location = response.headers.get("location")
            if response.status_code not in endpoints.REDIRECTS or not location:
                raise RedirectRefused(
                    f"HTTP {response.status_code} not followed (only a 307 or 308 with a "
                    "Location keeps the method and body)"
                )
            here = str(response.request.url)
            url = endpoints.redirect_target(self.failover.coordinators, here, location)
            params = None  # the Location holds the whole URL, query included
        raise RedirectRefused(f"more than {MAX_REDIRECTS} redirects")

    def tell(self, path: str, body: BaseModel, reply: type[BaseModel], what: str) -> None:
        """POST a report the rank can do without: a failure is one warning, never raised."""
        try:
            self.call("POST", path, body, reply)
        except (CoordinatorUnavailable, httpx.HTTPStatusError) as e:
            logger.warning("could not report %s: %s", what, e)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
