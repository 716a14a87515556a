"""Ports and polling for tests that start servers and processes on 127.0.0.1."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the time of the call.

    The OS picks it while binding and the socket is closed again, so the port is free for
    a server the test starts next (or, unused, a port where a connection is refused).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], object], timeout: float = 5.0, what: str = "") -> None:
    """Poll ``predicate`` every 20 ms until it is truthy; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what or 'condition'} not reached in {timeout} s"
        time.sleep(0.02)
