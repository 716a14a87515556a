"""What the coordinator benchmarks share: a raw keep-alive HTTP/1.1 client cheap enough not
to be the bottleneck, starting a real ``checkflow serve`` (SQLite path or, once the server
supports it, a ``postgresql://`` URL), and reading a process's CPU from ``/proc``.

Not a package: the scripts put ``benchmarks/`` on ``sys.path`` (``recovery.py`` imports
``start_server`` through ``coordinator.py``).
"""

from __future__ import annotations

import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TOKEN = "bench"
SERVE = "import sys; from checkflow.cli import main; sys.exit(main(sys.argv[1:]))"


class HttpConn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request in flight."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's own class

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self.buf[:end]).lower()
        i = head.find(b"content-length:")
        length = int(head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None])
        if len(self.buf) < end + 4 + length:
            return
        status = int(self.buf[9:12])
        body = bytes(self.buf[end + 4 : end + 4 + length])
        del self.buf[: end + 4 + length]
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((status, body))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))

    async def request(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionError("connection closed")
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(
            f"{method} {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        return await self.waiter

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def connect(port: int, host: str = "127.0.0.1") -> HttpConn:
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(HttpConn, host, port)
    return conn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def runqueue_wait_s(pid: int) -> float:
    """Seconds the process's threads waited for a CPU while runnable (scheduler contention)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def pct(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0 < q < 100, in steps of 0.1) of ``values``."""
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=1000)[int(q * 10) - 1]


def start_server(
    db: Path | str,
    port: int,
    *extra: str,
    cpus: set[int] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``checkflow serve`` on 127.0.0.1:``port`` against ``db`` (a SQLite path, or a
    ``postgresql://`` URL where the server supports it), answering ``/healthz``.

    ``extra`` are more ``serve`` options (``--advertise-url ...``); ``cpus`` pins the
    server to those cores. A server that exits instead of answering (an option or a URL it
    does not know) fails with its own error, in one message.
    """
    cmd = [sys.executable, "-c", SERVE, "serve", "--port", str(port), "--db", str(db)]
    cmd += ["--token", TOKEN, "--log-level", "error", *extra]
    # stderr to a file, not a pipe: a pipe nobody reads would stop the server when full.
    log = tempfile.TemporaryFile()  # noqa: SIM115  (lives as long as the server)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env or None)
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            error = log.read().decode(errors="replace").strip()[-2000:]
            raise RuntimeError(
                f"checkflow serve {' '.join(extra)} exited {proc.returncode}: {error}"
            )
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=0.5).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise TimeoutError("coordinator did not start")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
