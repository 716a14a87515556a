"""Peer copies of the RAM tier: each node's agent sends its ranks' RAM-tier steps to one
other node's agent, which keeps them in its own node memory; a node that lost its memory
(replaced, rebooted) fetches them back before its workers start.

The ring is given on each node: ``checkflow run --ram-tier --ram-listen PORT --ram-peer
HOST:PORT``: this node's agent receives its predecessor's copies on ``--ram-listen`` and
sends its own to ``--ram-peer``, from which it also fetches them back. Everything runs in
the agent's daemon threads, never in a worker: training does not wait for a copy.

Wire (TCP, one request per connection), a JSON header line then raw bytes:

- ``{"op": "put", "node": N, "path": P, "size": n}`` + n bytes -> ``ok``: store a file of
  node N's area (``rank-RRRRR/step-SSSSSSSSS/FILE``). A step's ``MANIFEST.json`` is sent
  last, so a step is committed at the peer only once all of it is there (format 1's rule).
- ``{"op": "drop", "node": N, "path": P}`` -> ``ok``: node N no longer holds that step.
- ``{"op": "get", "node": N}`` -> for each file ``{"path": P, "size": n}`` + n bytes, then
  ``{"end": true}``: every committed step held for node N.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import socket
import socketserver
import threading
from collections.abc import Iterator
from typing import Any

from checkflow.memory.area import _safe

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
SCAN_INTERVAL_S = 0.2
"""How often the sender looks for new RAM-tier steps on this node."""
TIMEOUT_S = 30.0


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``PORT`` (on 127.0.0.1)."""
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


# --- the receiving side --------------------------------------------------------------------
class PeerStore(socketserver.ThreadingTCPServer):
    """Holds other nodes' copies under ``<area>/peers/<node>/``; serves them back."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], area: str) -> None:
        self.folder = os.path.join(area, "peers")
        super().__init__(address, _Handler)
        self._thread = threading.Thread(
            target=self.serve_forever, name="checkflow-ram-peer-store", daemon=True
        )

    def start(self) -> PeerStore:
        self._thread.start()
        log.info("checkflow: holding peers' RAM tiers in %s (port %d)", self.folder, self.port)
        return self

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def close(self) -> None:
        self.shutdown()
        self.server_close()

    def node_folder(self, node: str) -> str:
        return os.path.join(self.folder, _safe(node))


class _Handler(socketserver.StreamRequestHandler):
    server: PeerStore

    def handle(self) -> None:
        try:
            self._serve(json.loads(self.rfile.readline()))
        except (ValueError, KeyError, TypeError) as e:  # a bad or hostile request: no reply
            log.warning("checkflow: refused a RAM-tier peer request: %s", e)

    def _serve(self, header: dict[str, Any]) -> None:
        base = self.server.node_folder(str(header["node"]))
        if header["op"] == "put":
            _receive(self.rfile, _inside(base, header["path"]), int(header["size"]))
        elif header["op"] == "drop":
            shutil.rmtree(_inside(base, header["path"]), ignore_errors=True)
        elif header["op"] == "get":
            for rel in committed_files(base):
                _send_file(self.wfile, base, rel)
            self.wfile.write(b'{"end": true}\n')
            return
        self.wfile.write(b"ok\n")


def _inside(base: str, rel: str) -> str:
    """``base/rel``, refusing a path that climbs out of ``base`` (a hostile peer)."""
    path = os.path.normpath(os.path.join(base, rel))
    if not path.startswith(os.path.normpath(base) + os.sep):
        raise ValueError(f"{rel!r} is not a path inside {base}")
    return path


def _receive(stream: io.BufferedIOBase, path: str, size: int) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{threading.get_ident()}"
    with open(tmp, "wb") as f:
        left = size
        while left:
            chunk = stream.read(min(left, 1 << 20))
            if not chunk:
                raise ConnectionError(
                    f"peer closed the connection with {left} bytes of {path} left"
                )
            f.write(chunk)
            left -= len(chunk)
    os.replace(tmp, path)


def _send_file(stream: io.BufferedIOBase, base: str, rel: str) -> None:
    path = os.path.join(base, rel)
    size = os.path.getsize(path)
    stream.write(json.dumps({"path": rel, "size": size}).encode() + b"\n")
    with open(path, "rb") as f:
        shutil.copyfileobj(f, stream, 1 << 20)


def committed_files(base: str) -> Iterator[str]:
    """Relative paths of every file of every committed step under ``base`` (a node's area
    or a peer's copy of it), each step's ``MANIFEST.json`` last."""
    for step in sorted(committed_step_folders(base)):
        yield from step_files(base, step)


def committed_step_folders(base: str) -> set[str]:
    """``rank-RRRRR/step-SSSSSSSSS`` of every committed step under ``base``."""
    found = set()
    for rank in _subdirs(base):
        if rank.startswith("rank-"):
            for step in _subdirs(os.path.join(base, rank)):
                if os.path.exists(os.path.join(base, rank, step, MANIFEST)):
                    found.add(f"{rank}/{step}")
    return found


def step_files(base: str, step: str) -> list[str]:
    """The files of one step folder, ``MANIFEST.json`` last (temporary files left out)."""
    names = sorted(n for n in os.listdir(os.path.join(base, step)) if ".tmp" not in n)
    names.remove(MANIFEST)
    return [f"{step}/{n}" for n in [*names, MANIFEST]]


def _subdirs(folder: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(folder) if e.is_dir()]
    except FileNotFoundError:
        return []


# --- the sending side ----------------------------------------------------------------------
class PeerSender:
    """Sends this node's committed RAM-tier steps to its peer, and drops there the steps
    retention removed here; a daemon thread that looks every :data:`SCAN_INTERVAL_S`."""

    def __init__(self, area: str, node: str, peer: tuple[str, int]) -> None:
        self.area, self.node, self.peer = area, node, peer
        self.sent: set[str] = set()
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="checkflow-ram-peer", daemon=True)

    def start(self) -> PeerSender:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT_S)

    def _run(self) -> None:
        while not self._stop.wait(SCAN_INTERVAL_S):
            try:
                self.sync_once()
                self._failing = False
            except (OSError, ValueError) as e:  # the peer is down or restarting: retry
                if not self._failing:
                    log.warning("checkflow: RAM-tier copy to peer %s:%d failed: %s", *self.peer, e)
                self._failing = True

    def sync_once(self) -> int:
        """Send the steps not sent yet, drop those gone; how many steps were sent."""
        here = committed_step_folders(self.area)
        sent = 0
        for step in sorted(here - self.sent):
            for rel in step_files(self.area, step):
                with open(os.path.join(self.area, rel), "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    self._request({"op": "put", "path": rel, "size": size}, f)
            self.sent.add(step)
            sent += 1
        for step in sorted(self.sent - here):
            self._request({"op": "drop", "path": step})
            self.sent.discard(step)
        return sent

    def _request(self, header: dict[str, Any], body: io.BufferedIOBase | None = None) -> None:
        with socket.create_connection(self.peer, timeout=TIMEOUT_S) as sock:
            stream = sock.makefile("rwb")
            stream.write(json.dumps({**header, "node": self.node}).encode() + b"\n")
            if body is not None:
                shutil.copyfileobj(body, stream, 1 << 20)
            stream.flush()
            if stream.readline().strip() != b"ok":
                raise ConnectionError(f"peer {self.peer} refused {header['op']} {header['path']}")


def fetch(peer: tuple[str, int], node: str, area: str) -> int:
    """Copy back into ``area`` every step the peer holds for ``node``: what this node's
    memory held before it was lost. Returns how many files came back (0 when the peer
    cannot be reached: the workers then restore from storage)."""
    files = 0
    try:
        with socket.create_connection(peer, timeout=TIMEOUT_S) as sock:
            stream = sock.makefile("rwb")
            stream.write(json.dumps({"op": "get", "node": node}).encode() + b"\n")
            stream.flush()
            while not (header := json.loads(stream.readline())).get("end"):
                _receive(stream, _inside(area, header["path"]), int(header["size"]))
                files += 1
    except ConnectionRefusedError:  # the peer's agent is not up (yet): a first start
        log.info("checkflow: no peer at %s:%d to fetch node %s's RAM tier from", *peer, node)
    except (OSError, ValueError) as e:
        log.warning("checkflow: could not fetch node %s's RAM tier from %s:%d: %s", node, *peer, e)
    if files:
        log.warning(
            "checkflow: node %s's RAM tier: %d files fetched from peer %s:%d", node, files, *peer
        )
    return files
