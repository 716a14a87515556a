"""The peer ring attacked over real TCP on 127.0.0.1 (issue 31): a message not signed with
the job's key, signed for another job, replayed, stale, cut off, or a header that never
ends is refused, and the store's files stay exactly as they were; agents that share the
secret still exchange copies."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from checkflow.memory import wire
from checkflow.memory.peer import PeerSender, PeerStore, fetch, parse_address
from checkflow.memory.wire import REQUEST, Message, NoSecretError, RingKey
from tests.memory.test_peer import write_step
from tests.support.net import wait_until
from tests.support.paths import REPO

SECRET = b"the job's secret"
RING = RingKey.derive(SECRET, "job-1")
STRANGER = RingKey.derive(b"not the secret", "job-1")
OTHER_JOB = RingKey.derive(SECRET, "job-2")
STEP_FILE = "rank-00000/step-000000007/MANIFEST.json"


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def holding(tmp_path: Path):
    """A store that holds node B's step 5 (sent by a real sender with the secret)."""
    store = PeerStore(("127.0.0.1", 0), str(tmp_path / "peer-area"), RING).start()
    write_step(tmp_path / "node-area", 0, 5)
    assert PeerSender(str(tmp_path / "node-area"), "B", ("127.0.0.1", store.port), RING).sync_once()
    yield store
    store.close()


def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw``, half-close, and return everything the store answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        return sock.makefile("rb").read()


def signed(ring: RingKey, fields: dict) -> Message:
    """A request with exactly these fields, correctly signed with ``ring``'s key."""
    return Message(fields, ring._tag(REQUEST, wire._canonical(fields)))


def put_line(ring: RingKey, body: bytes, **override) -> bytes:
    message = wire.request(ring, "put", "B", path=STEP_FILE, size=len(body))
    if override:
        message = signed(ring, {**message.fields, **override})
    trailer = ring.body_mac(message.tag)
    trailer.update(body)
    return message.line + body + trailer.digest()


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(
            b'{"op": "put", "node": "B", "path": "' + STEP_FILE.encode() + b'", "size": 2}\n{}',
            id="unsigned-first-format",
        ),
        pytest.param(put_line(STRANGER, b"{}"), id="wrong-secret"),
        pytest.param(put_line(OTHER_JOB, b"{}"), id="same-secret-other-job"),
        pytest.param(put_line(RING, b"{}")[:-3] + b"xyz", id="body-trailer-forged"),
        pytest.param(put_line(RING, b"{}").replace(b'"size":2', b'"size":3'), id="header-edited"),
        pytest.param(b"00" * 32 + b" {}\n", id="garbage-tag"),
    ],
)
def test_a_forged_put_is_refused_and_the_store_is_unchanged(holding, raw):
    folder = Path(holding.folder)
    before = files(folder)
    assert exchange(holding.port, raw) == b"", "no reply to a forged message"
    assert files(folder) == before
    assert not (folder / "B" / "rank-00000" / "step-000000007").exists()


@pytest.mark.parametrize("op", ["get", "drop"])
@pytest.mark.parametrize("how", ["unsigned", "wrong-secret", "other-job"])
def test_get_and_drop_without_the_secret_are_refused(holding, tmp_path, op, how):
    folder = Path(holding.folder)
    before = files(folder)
    fields = {"path": "rank-00000/step-000000005"} if op == "drop" else {}
    if how == "unsigned":
        raw = (str({"op": op, "node": "B", **fields}).replace("'", '"') + "\n").encode()
    else:
        raw = wire.request(STRANGER if how == "wrong-secret" else OTHER_JOB, op, "B", **fields).line
    assert exchange(holding.port, raw) == b"", "not a byte of B's copies, no ok"
    assert files(folder) == before
    assert fetch(("127.0.0.1", holding.port), "B", str(tmp_path / "thief"), STRANGER) == 0
    assert not (tmp_path / "thief").exists() or files(tmp_path / "thief") == {}


def test_a_valid_put_replayed_is_refused_and_a_stale_one_too(holding):
    folder = Path(holding.folder)
    raw = put_line(RING, b'{"planted": 1}')
    assert b'"ok":true' in exchange(holding.port, raw)
    planted = folder / "B" / STEP_FILE
    assert planted.read_bytes() == b'{"planted": 1}'
    planted.unlink()  # the node's retention dropped it since
    assert exchange(holding.port, raw) == b"", "the same message again: a replay"
    assert not planted.exists()

    stale = put_line(RING, b"{}", time=time.time() - wire.MAX_SKEW_S - 5)
    assert exchange(holding.port, stale) == b""
    assert not planted.exists()


def test_a_cut_off_upload_leaves_no_temporary_file_and_the_store_still_works(holding):
    folder = Path(holding.folder)
    before = files(folder)
    message = wire.request(RING, "put", "B", path=STEP_FILE, size=4 << 20)
    with socket.create_connection(("127.0.0.1", holding.port), timeout=10) as sock:
        sock.sendall(message.line + b"x" * (1 << 20))  # a quarter, then the sender dies
        wait_until(lambda: list(folder.glob(".incoming-*.tmp")), 5, "the upload under way")
    wait_until(lambda: not list(folder.rglob("*.tmp*")), 5, "the partial upload removed")
    assert files(folder) == before
    assert b'"ok":true' in exchange(holding.port, put_line(RING, b"{}"))


def test_partial_uploads_left_by_a_killed_agent_are_swept_when_the_store_starts(tmp_path):
    peers = tmp_path / "area" / "peers"
    step = peers / "B" / "rank-00000" / "step-000000005"
    step.mkdir(parents=True, mode=0o700)
    (step / "MANIFEST.json").write_text("{}")
    (step / "chunk.tmp-1234").write_bytes(b"first format")
    (peers / ".incoming-abc.tmp").write_bytes(b"this format")
    PeerStore(("127.0.0.1", 0), str(tmp_path / "area"), RING).server_close()
    assert files(peers) == {"B/rank-00000/step-000000005/MANIFEST.json": b"{}"}


_STORE = """
import sys, time
from checkflow.memory.peer import PeerStore
from checkflow.memory.wire import RingKey
store = PeerStore(("127.0.0.1", 0), sys.argv[1], RingKey.derive(b"s", "j")).start()
print(store.port, flush=True)
time.sleep(600)
"""


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


def test_a_96_mib_header_without_a_newline_is_cut_off_and_costs_the_agent_no_memory(tmp_path):
    agent = subprocess.Popen(
        [sys.executable, "-c", _STORE, str(tmp_path / "area")],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert agent.stdout is not None
        port = int(agent.stdout.readline())
        time.sleep(0.5)
        before = _rss_kib(agent.pid)
        sent, closed = 0, False
        block = b"A" * (1 << 20)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            try:
                while sent < 96 << 20:
                    sock.sendall(block)
                    sent += len(block)
                closed = sock.recv(1) == b""
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed, "the agent closed the connection"
        assert sent < 16 << 20, f"the agent read {sent >> 20} MiB of one header"
        grown = _rss_kib(agent.pid) - before
        assert grown < 4096, f"the agent grew by {grown} KiB"
        assert agent.poll() is None, "and it still runs"
    finally:
        agent.kill()
        agent.wait()


def test_a_fake_peer_that_answers_unsigned_files_plants_nothing(tmp_path):
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.makefile("rb").readline()
            header = f'{{"path": "{STEP_FILE}", "size": 2}}\n'
            conn.sendall(header.encode() + b"{}" + b'{"end": true}\n')

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    area = tmp_path / "replacement"
    assert fetch(listener.getsockname(), "B", str(area), RING) == 0
    thread.join(10)
    listener.close()
    assert files(area) == {}, "no file, no temporary file"


def test_two_agents_with_the_same_secret_exchange_copies(holding, tmp_path):
    fresh = tmp_path / "replacement"
    assert fetch(("127.0.0.1", holding.port), "B", str(fresh), RING) == 3
    assert files(fresh) == files(tmp_path / "node-area")


def test_the_key_is_bound_to_the_secret_and_the_job():
    keys = {RING.key, STRANGER.key, OTHER_JOB.key, RingKey.derive(SECRET, "job-1").key}
    assert len(keys) == 3 and len(RING.key) == 32


def test_the_secret_comes_from_the_file_else_the_token_else_nothing_starts(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"s3cret\n")
    assert wire.read_secret(str(secret), "token") == b"s3cret"
    assert wire.read_secret(None, "token") == b"token"
    with pytest.raises(NoSecretError, match="--ram-secret-file PATH"):
        wire.read_secret(None, None)
    (tmp_path / "empty").write_bytes(b"\n")
    with pytest.raises(NoSecretError, match="is empty"):
        wire.read_secret(str(tmp_path / "empty"), "token")
    with pytest.raises(NoSecretError, match="No such file"):
        wire.read_secret(str(tmp_path / "missing"), "token")


def test_the_listen_address_is_explicit_and_a_bare_port_still_works_with_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_address("0.0.0.0:29600") == ("0.0.0.0", 29600)
        assert parse_address("[::1]:29600") == ("::1", 29600)
    with pytest.warns(FutureWarning, match="binds 127.0.0.1 only"):
        assert parse_address("29600") == ("127.0.0.1", 29600)
