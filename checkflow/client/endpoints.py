"""The coordinator URLs a client may use, and which of them it tries first.

A coordinator can run as several replicas (issue 33); every setting that names one
(``coordinator=``, ``CHECKFLOW_COORDINATOR``, ``--coordinator``, ``checkflow status URL``)
takes a comma-separated list, ``http://a:8470,http://b:8470``. :func:`parse` checks it
(the values are hostile: from the environment, a manifest, a command line) and every
caller (:class:`~checkflow.client.transport.Channel`) asks :class:`Failover` for the order
to try them in: the one that answered last first, so a client sticks to a working replica
and leaves a dead one after one failure.

A redirect is followed only to one of the listed URLs' origins (:func:`redirect_target`):
the request carries the bearer token, and a replica that is hostile, or just
misconfigured, must not be able to send it to a host the user did not name.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

MAX_URLS = 32
"""The most URLs one list may hold: a list is a few replicas, never thousands."""
MAX_URL_LENGTH = 2048
SCHEMES = ("http", "https")
REDIRECTS = (307, 308)
"""The redirects followed: the ones that keep the method and the body."""


class BadCoordinatorList(ValueError):
    """A coordinator list that cannot be used; the message is one line naming the item."""


class RedirectRefused(ValueError):
    """A redirect this client does not follow; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class Coordinators:
    """A checked, non-empty list of coordinator base URLs (no trailing ``/``)."""

    urls: tuple[str, ...]

    def __str__(self) -> str:
        return ",".join(self.urls)

    def owner(self, url: str) -> str | None:
        """The listed base URL whose origin (scheme, host, port) ``url`` has, else None."""
        want = origin(url)
        return next((u for u in self.urls if origin(u) == want), None)


def parse(text: str) -> Coordinators:
    """The list in ``text``: URLs separated by commas, spaces around them ignored.

    Raises:
        BadCoordinatorList: an empty list or item, whitespace or control characters inside
            a URL, a scheme other than http(s), no host, a bad port, user info, a query or
            fragment, a URL listed twice, or more than :data:`MAX_URLS`.
    """
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise BadCoordinatorList(f"no coordinator URL in {text!r}; give http://HOST:PORT")
    if len(items) > MAX_URLS:
        raise BadCoordinatorList(f"{len(items)} coordinator URLs; at most {MAX_URLS}")
    urls: list[str] = []
    for n, item in enumerate(items, 1):
        url = _checked(item, n)
        if origin(url) + urlsplit(url).path in {origin(u) + urlsplit(u).path for u in urls}:
            raise BadCoordinatorList(f"coordinator URL {item!r} is listed twice; give it once")
        urls.append(url)
    return Coordinators(tuple(urls))


def _checked(item: str, n: int) -> str:
    where = f"coordinator URL {n} ({item!r})"
    if not item:
        raise BadCoordinatorList(f"coordinator URL {n} is empty: remove the extra comma")
    if len(item) > MAX_URL_LENGTH:
        raise BadCoordinatorList(f"coordinator URL {n} is over {MAX_URL_LENGTH} characters")
    if any(c.isspace() or not c.isprintable() for c in item):
        raise BadCoordinatorList(f"{where} holds whitespace or control characters")
    parts = urlsplit(item)
    if parts.scheme.lower() not in SCHEMES:
        raise BadCoordinatorList(f"{where} is not http:// or https://")
    try:
        parts.port  # noqa: B018 -- urlsplit checks the port only when asked
    except ValueError as e:
        raise BadCoordinatorList(f"{where} has a bad port: {e}") from None
    if not parts.hostname:
        raise BadCoordinatorList(f"{where} names no host")
    if "@" in parts.netloc:
        raise BadCoordinatorList(f"{where} holds user info: pass the token with --token-file")
    if parts.query or parts.fragment or item.endswith(("?", "#")):
        raise BadCoordinatorList(f"{where} has a query or fragment: give the base URL")
    return item.rstrip("/")


def origin(url: str) -> str:
    """``scheme://host:port`` of ``url``, lower-cased, with the scheme's default port."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    default = 443 if scheme == "https" else 80
    return f"{scheme}://{(parts.hostname or '').lower()}:{port or default}"


def redirect_target(coordinators: Coordinators, request_url: str, location: str) -> str:
    """The absolute URL a 307/308 answer to ``request_url`` points at.

    Raises:
        RedirectRefused: it is not on a listed origin (the token would leave the list).
    """
    target = urljoin(request_url, location)
    if coordinators.owner(target) is None:
        raise RedirectRefused(
            f"redirected to {origin(target)}, which is not one of the coordinator URLs "
            f"given ({coordinators}): not followed, so the token stays with them; add it "
            "to the list if it is a replica"
        )
    return target


class Failover:
    """Which listed URL a client tries first: the last one that answered. Shared by a
    client's connections (the heartbeat's and the reports'); thread-safe."""

    def __init__(self, coordinators: Coordinators) -> None:
        self.coordinators = coordinators
        self._first = 0
        self._lock = threading.Lock()

    def order(self) -> list[str]:
        """Every URL once, the current one first, then the rest in the list's order."""
        urls = self.coordinators.urls
        with self._lock:
            first = self._first
        return [urls[(first + i) % len(urls)] for i in range(len(urls))]

    @property
    def current(self) -> str:
        return self.order()[0]

    def answered(self, url: str) -> None:
        """``url`` (any URL on a listed origin) answered: try it first from now on."""
        base = self.coordinators.owner(url)
        if base is not None:
            with self._lock:
                self._first = self.coordinators.urls.index(base)

    def failed(self, base: str) -> None:
        """``base`` failed: when it is the current one, the next in the list is."""
        urls = self.coordinators.urls
        with self._lock:
            if urls[self._first] == base:
                self._first = (self._first + 1) % len(urls)
