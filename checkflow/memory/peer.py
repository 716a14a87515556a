"""Peer copies of the RAM tier: each node's agent sends its ranks' RAM-tier steps to one
other node's agent, which keeps them in its own node memory; a node that lost its memory
(replaced, rebooted) fetches them back before its workers start.

The ring is given on each node: ``checkflow run --ram-tier --ram-listen HOST:PORT
--ram-peer HOST:PORT``: this node's agent receives its predecessor's copies on
``--ram-listen`` and sends its own to ``--ram-peer``, from which it also fetches them back.
Everything runs in the agent's daemon threads, never in a worker: training does not wait.

Wire (TCP, one request per connection), every line signed with the job's ring key and
every body followed by its signature (:mod:`checkflow.memory.wire`); a request that does not
verify is answered with nothing and changes nothing:

- ``put`` ``{"node": N, "path": P, "size": n}`` + n bytes -> ``{"ok": true}``: store a file
  of node N's area (``rank-RRRRR/step-SSSSSSSSS/FILE``). A step's ``MANIFEST.json`` is
  sent last, so a step is committed at the peer only once all of it is there.
- ``drop`` ``{"node": N, "path": P}`` -> ``{"ok": true}``: node N no longer holds that step.
- ``get`` ``{"node": N}`` -> for each file ``{"path": P, "size": n}`` + n bytes, then
  ``{"end": true, "files": k}``: every committed step held for node N.

A body is received into a temporary file (``.incoming-*.tmp``) that is renamed into place
only once its signature verifies and removed on any failure; a store sweeps those left by a
killed agent when it starts.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import socket
import socketserver
import tempfile
import threading
import warnings
from collections.abc import Iterator

from checkflow.folders import private_folder
from checkflow.memory import wire
from checkflow.memory.area import _safe
from checkflow.memory.wire import REPLY, REQUEST, Message, RingKey

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
SCAN_INTERVAL_S = 0.2
"""How often the sender looks for new RAM-tier steps on this node."""
TIMEOUT_S = 30.0
"""A connection idle this long is closed (a peer that stalls holds no thread for good)."""
INCOMING = ".incoming-"
_STEP_PATH = re.compile(r"rank-[0-9]+/step-[0-9]+(/[A-Za-z0-9_.-]+)?")


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT``; a bare ``PORT`` still means 127.0.0.1 for one release, with a
    warning (it cannot work across nodes)."""
    host, _, port = text.rpartition(":")
    if not host:
        warnings.warn(
            f"--ram-listen {text}: a bare port is deprecated and binds 127.0.0.1 only; write "
            f"127.0.0.1:{text}, or <this node's address>:{text} for a ring across nodes",
            FutureWarning,
            stacklevel=2,
        )
    return host.strip("[]") or "127.0.0.1", int(port)


# --- the receiving side --------------------------------------------------------------------
class PeerStore(socketserver.ThreadingTCPServer):
    """Holds other nodes' copies under ``<area>/peers/<node>/``; serves them back to
    requests signed with ``ring``."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], area: str, ring: RingKey) -> None:
        self.folder = private_folder(os.path.join(area, "peers"), what="RAM-tier peer store")
        self.ring = ring
        self.nonces = wire.Nonces()
        swept = sweep_partial(self.folder)
        if swept:
            log.warning("checkflow: removed %d partial peer uploads from %s", swept, self.folder)
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
    timeout = TIMEOUT_S

    def handle(self) -> None:
        ring = self.server.ring
        try:
            message = wire.read_message(self.rfile, ring, REQUEST)
            wire.check_request(message, ring, self.server.nonces)
            self._serve(message)
        except (OSError, ValueError, KeyError, TypeError) as e:  # hostile or cut off: no reply
            log.warning(
                "checkflow: refused a RAM-tier peer request from %s: %s", self.client_address[0], e
            )

    def _serve(self, message: Message) -> None:
        ring, header = self.server.ring, message.fields
        node = self.server.node_folder(str(header["node"]))
        if header["op"] == "put":
            path = _inside(node, header["path"], file=True)
            _receive(self.rfile, ring, message, path, _size(header), self.server.folder)
        elif header["op"] == "drop":
            shutil.rmtree(_inside(node, header["path"], file=False), ignore_errors=True)
        elif header["op"] == "get":
            sent = 0
            for rel in committed_files(node):
                _send_file(self.wfile, ring, message, sent, node, rel)
                sent += 1
            self.wfile.write(wire.reply(ring, message, sent, end=True, files=sent).line)
            return
        else:
            raise ValueError(f"unknown op {header['op']!r}")
        self.wfile.write(wire.reply(ring, message, 0, ok=True).line)


def _inside(base: str, rel: object, *, file: bool) -> str:
    """``base/rel`` for ``rel`` of the form ``rank-R/step-S[/FILE]`` (with ``FILE`` when
    ``file``), refusing anything else (a path that climbs out of ``base``, say)."""
    if not isinstance(rel, str) or not _STEP_PATH.fullmatch(rel) or (rel.count("/") == 2) != file:
        raise ValueError(f"{rel!r} is not a RAM-tier step {'file' if file else 'folder'} path")
    return os.path.join(base, rel)


def _size(header: dict[str, object]) -> int:
    size = header["size"]
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"size {size!r} is not a byte count")
    return size


def _receive(
    stream: io.BufferedIOBase, ring: RingKey, header: Message, path: str, size: int, tmp_dir: str
) -> None:
    """The body after ``header`` into ``path``, kept only when its signature verifies; the
    temporary file is gone whatever happens (a cut-off upload leaves nothing)."""
    os.makedirs(tmp_dir, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=INCOMING, suffix=".tmp", dir=tmp_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            wire.read_body(stream, ring, header, size, f)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def sweep_partial(folder: str) -> int:
    """Remove the temporary files of uploads cut off by a killed agent under ``folder``
    (this format's ``.incoming-*.tmp`` and the first format's ``FILE.tmp-N``)."""
    removed = 0
    for parent, _dirs, names in os.walk(folder):
        for name in names:
            if (name.startswith(INCOMING) and name.endswith(".tmp")) or ".tmp-" in name:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(parent, name))
                    removed += 1
    return removed


def _send_file(
    stream: io.BufferedIOBase, ring: RingKey, to: Message, seq: int, base: str, rel: str
) -> None:
    with open(os.path.join(base, rel), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header = wire.reply(ring, to, seq, path=rel, size=size)
        stream.write(header.line)
        wire.write_body(stream, ring, header, f, size)


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

    def __init__(self, area: str, node: str, peer: tuple[str, int], ring: RingKey) -> None:
        self.area, self.node, self.peer, self.ring = area, node, peer, ring
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
                    self._request("put", rel, size, f)
            self.sent.add(step)
            sent += 1
        for step in sorted(self.sent - here):
            self._request("drop", step)
            self.sent.discard(step)
        return sent

    def _request(
        self, op: str, rel: str, size: int | None = None, body: io.BufferedIOBase | None = None
    ) -> None:
        fields = {"path": rel} if size is None else {"path": rel, "size": size}
        message = wire.request(self.ring, op, self.node, **fields)
        with socket.create_connection(self.peer, timeout=TIMEOUT_S) as sock:
            stream = sock.makefile("rwb")
            stream.write(message.line)
            if body is not None and size is not None:
                wire.write_body(stream, self.ring, message, body, size)
            stream.flush()
            answer = wire.read_message(stream, self.ring, REPLY)
            wire.check_reply(answer, message, 0)
            if answer.fields.get("ok") is not True:
                raise ConnectionError(f"peer {self.peer} refused {op} {rel}")


def fetch(peer: tuple[str, int], node: str, area: str, ring: RingKey) -> int:
    """Copy back into ``area`` every step the peer holds for ``node``: what this node's
    memory held before it was lost. Only replies signed with ``ring``'s key are taken.
    Returns how many files came back (0 when the peer cannot be reached: the workers then
    restore from storage)."""
    files = 0
    try:
        files = _fetch(peer, node, area, ring)
    except ConnectionRefusedError:  # the peer's agent is not up (yet): a first start
        log.info("checkflow: no peer at %s:%d to fetch node %s's RAM tier from", *peer, node)
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("checkflow: could not fetch node %s's RAM tier from %s:%d: %s", node, *peer, e)
    return files


def _fetch(peer: tuple[str, int], node: str, area: str, ring: RingKey) -> int:
    files = 0
    message = wire.request(ring, "get", node)
    try:
        with socket.create_connection(peer, timeout=TIMEOUT_S) as sock:
            stream = sock.makefile("rwb")
            stream.write(message.line)
            stream.flush()
            while True:
                answer = wire.read_message(stream, ring, REPLY)
                wire.check_reply(answer, message, files)
                header = answer.fields
                if header.get("end"):
                    if header.get("files") != files:
                        raise wire.RefusedMessage(
                            f"the reply ends after {files} files, not {header.get('files')}"
                        )
                    return files
                path = _inside(area, header["path"], file=True)
                _receive(stream, ring, answer, path, _size(header), area)
                files += 1
    finally:
        if files:
            log.warning(
                "checkflow: node %s's RAM tier: %d files fetched from peer %s:%d",
                node,
                files,
                *peer,
            )
