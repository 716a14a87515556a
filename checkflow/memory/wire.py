"""The peer ring's messages, authenticated: who holds the job's secret may talk, no one else.

Anyone who reaches an agent's ``--ram-listen`` port could otherwise read a node's copies
(the model and optimizer bytes), drop them, or plant a step that a replaced node fetches
back as its own (issue 31). So every message is signed with HMAC-SHA256 under a key that
:meth:`RingKey.derive` takes (HKDF, RFC 5869) from the secret the job's agents share (a
``--ram-secret-file``, or the job's coordinator token) and the job's name:

- a message is one header line, ``<hex tag> <json>\\n``, at most :data:`MAX_HEADER` bytes
  (a longer line is refused without reading on: no unbounded buffer). The tag covers the
  protocol name, the direction (a request, or a reply: one is never taken for the other)
  and the JSON, which names the job, a fresh random ``nonce`` and the sender's ``time``;
- a body of ``size`` bytes follows when the header says so, then a 32-byte trailer: the
  HMAC of the header's tag and the body. The receiver streams the body into a temporary
  file with a running HMAC and keeps the file only once the trailer verifies;
- a request is taken once: its job must be the receiver's, its time within
  :data:`MAX_SKEW_S` of the receiver's clock, its nonce not seen before (:class:`Nonces`),
  so a message captured from another job, or an earlier step of this one, is refused;
- a reply names the request's nonce (``re``) and its place in the reply (``seq``).

The tag is checked before anything in the header is used, so an unauthenticated message
costs the receiver one bounded line and no disk.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

PROTOCOL = b"checkflow-ram-peer/2"
MAX_HEADER = 64 * 1024
"""Longest header line, in bytes; real ones are under 300."""
MAX_SKEW_S = 300.0
"""A request older or newer than this, by the receiver's clock, is refused."""
TAG_BYTES = hashlib.sha256().digest_size
REQUEST, REPLY = b"request", b"reply"


class RefusedMessage(ValueError):
    """A message that is not authentic, not fresh, not for this job, or not well formed."""


class NoSecretError(ValueError):
    """The ring was asked for without a secret to sign its messages with."""


def read_secret(secret_file: str | None, token: str | None) -> bytes:
    """The ring's secret: the contents of ``secret_file``, else the coordinator ``token``.

    Raises:
        NoSecretError: neither, or an empty or unreadable file.
    """
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                secret = f.read(MAX_HEADER).strip()
        except OSError as e:
            raise NoSecretError(
                f"--ram-secret-file {secret_file}: {e.strerror}; give a readable file"
            ) from None
        if not secret:
            raise NoSecretError(f"--ram-secret-file {secret_file} is empty; write a secret in it")
        return secret
    if token:
        return token.encode()
    raise NoSecretError(
        "the RAM-tier peer ring (--ram-listen/--ram-peer) signs its messages with a secret "
        "the job's nodes share: give --ram-secret-file PATH (the same file on every node) "
        "or the job's coordinator token (CHECKFLOW_TOKEN)"
    )


@dataclass(frozen=True, slots=True)
class RingKey:
    """The signing key of one job's ring, and the job it is for."""

    key: bytes
    job: str

    @classmethod
    def derive(cls, secret: bytes, job: str) -> RingKey:
        """HKDF-SHA256 of ``secret``, bound to ``job``: another job's messages never verify,
        even under the same secret."""
        prk = hmac.new(PROTOCOL, secret, hashlib.sha256).digest()
        info = PROTOCOL + b"\0ring key\0" + job.encode()
        return cls(hmac.new(prk, info + b"\x01", hashlib.sha256).digest(), job)

    def _tag(self, direction: bytes, body: bytes) -> bytes:
        return hmac.new(
            self.key, PROTOCOL + b"\0" + direction + b"\0" + body, hashlib.sha256
        ).digest()

    def body_mac(self, header_tag: bytes) -> Any:
        """The running HMAC of a body, chained to its header's tag."""
        return hmac.new(self.key, PROTOCOL + b"\0body\0" + header_tag, hashlib.sha256)


@dataclass(frozen=True, slots=True)
class Message:
    """One header: its fields and its tag (a body's trailer is chained to the tag)."""

    fields: dict[str, Any]
    tag: bytes

    @property
    def line(self) -> bytes:
        return self.tag.hex().encode() + b" " + _canonical(self.fields) + b"\n"


def _canonical(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def request(ring: RingKey, op: str, node: str, **fields: Any) -> Message:
    """A signed request of ``op`` for ``node``'s copies, with a fresh nonce."""
    body = {**fields, "op": op, "node": node, "job": ring.job}
    body |= {"nonce": os.urandom(16).hex(), "time": time.time()}
    return Message(body, ring._tag(REQUEST, _canonical(body)))


def reply(ring: RingKey, to: Message, seq: int, **fields: Any) -> Message:
    """The ``seq``-th signed line of the reply to the request ``to``."""
    body = {**fields, "re": to.fields["nonce"], "seq": seq}
    return Message(body, ring._tag(REPLY, _canonical(body)))


def read_message(stream: io.BufferedIOBase, ring: RingKey, direction: bytes) -> Message:
    """The next header on ``stream``, its tag verified before its JSON is parsed.

    Raises:
        ConnectionError: the stream ended before a header.
        RefusedMessage: too long, not signed with ``ring``'s key, or not a JSON object.
    """
    line = stream.readline(MAX_HEADER + 1)
    if not line:
        raise ConnectionError("the connection closed before a message")
    if not line.endswith(b"\n"):
        raise RefusedMessage(f"a header line longer than {MAX_HEADER} bytes")
    tag_hex, _, body = line[:-1].partition(b" ")
    tag = ring._tag(direction, body)
    if not hmac.compare_digest(tag_hex, tag.hex().encode()):
        raise RefusedMessage("a message not signed with this job's ring key")
    fields = json.loads(body)
    if not isinstance(fields, dict):
        raise RefusedMessage("a header that is not a JSON object")
    return Message(fields, tag)


def check_request(message: Message, ring: RingKey, seen: Nonces) -> None:
    """Refuse a signed request meant for another job, stale, or seen before (a replay)."""
    fields = message.fields
    if fields.get("job") != ring.job:
        raise RefusedMessage(f"a request for job {fields.get('job')!r}, not {ring.job!r}")
    sent = fields.get("time")
    if not isinstance(sent, (int, float)) or abs(time.time() - sent) > MAX_SKEW_S:
        raise RefusedMessage(f"a request sent at {sent!r}, over {MAX_SKEW_S:.0f} s from now")
    if not seen.first(str(fields.get("nonce"))):
        raise RefusedMessage("a request seen before (replayed)")


def check_reply(message: Message, to: Message, seq: int) -> None:
    """Refuse a signed reply to another request, or out of its place."""
    if message.fields.get("re") != to.fields["nonce"] or message.fields.get("seq") != seq:
        raise RefusedMessage("a reply to another request, or out of order")


def write_body(
    stream: io.BufferedIOBase, ring: RingKey, header: Message, src: io.BufferedIOBase, size: int
) -> None:
    """Send the first ``size`` bytes of ``src`` (the header's ``size``), then the trailer
    that signs them.

    Raises:
        ValueError: ``src`` holds fewer bytes (it changed since it was measured).
    """
    mac = ring.body_mac(header.tag)
    left = size
    while left:
        chunk = src.read(min(left, 1 << 20))
        if not chunk:
            raise ValueError(f"{left} of {size} bytes to send are missing")
        mac.update(chunk)
        stream.write(chunk)
        left -= len(chunk)
    stream.write(mac.digest())


def read_body(
    stream: io.BufferedIOBase, ring: RingKey, header: Message, size: int, out: io.BufferedIOBase
) -> None:
    """Copy the ``size``-byte body that follows ``header`` into ``out`` and verify its
    trailer; the caller keeps ``out`` only when this returns.

    Raises:
        ConnectionError: the stream ended early (a cut-off upload).
        RefusedMessage: the trailer does not sign these bytes.
    """
    mac = ring.body_mac(header.tag)
    left = size
    while left:
        chunk = stream.read(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError(f"the connection closed with {left} of {size} bytes left")
        mac.update(chunk)
        out.write(chunk)
        left -= len(chunk)
    trailer = stream.read(TAG_BYTES)
    if not hmac.compare_digest(trailer, mac.digest()):
        raise RefusedMessage("a body whose trailer does not sign it")


class Nonces:
    """Nonces of the requests taken in the last ``2 * MAX_SKEW_S`` seconds: a request is
    taken once. Only signed requests get here, so the set grows only with real traffic."""

    def __init__(self) -> None:
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()

    def first(self, nonce: str) -> bool:
        """Record ``nonce``; False when it was recorded before."""
        now = time.monotonic()
        with self._lock:
            if len(self._seen) > 1024:
                self._seen = {n: t for n, t in self._seen.items() if now - t < 2 * MAX_SKEW_S}
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            return True
