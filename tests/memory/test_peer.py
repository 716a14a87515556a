"""The peer copy protocol in one process, over real TCP on 127.0.0.1: a node's committed
RAM-tier steps reach its peer, retention there follows the node, a partial step is not sent,
and a node that lost its memory gets every committed file back byte for byte."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from checkflow.memory import wire
from checkflow.memory.peer import PeerSender, PeerStore, committed_step_folders, fetch
from checkflow.memory.wire import RingKey

RING = RingKey.derive(b"the job's secret", "job-1")


def write_step(area: Path, rank: int, step: int, *, commit: bool = True) -> None:
    folder = area / f"rank-{rank:05d}" / f"step-{step:09d}"
    folder.mkdir(parents=True)
    (folder / "rank-00000-000.chunks").write_bytes(bytes(range(256)) * (step + 1))
    (folder / "rank-00000.json").write_text(f'{{"step": {step}}}')
    if commit:
        (folder / "MANIFEST.json").write_text(f'{{"step": {step}, "world_size": 1}}')


@pytest.fixture
def peer(tmp_path: Path):
    store = PeerStore(("127.0.0.1", 0), str(tmp_path / "peer-area"), RING).start()
    yield store
    store.close()


def test_committed_steps_reach_the_peer_and_retention_there_follows_the_node(
    tmp_path: Path, peer: PeerStore
) -> None:
    area = tmp_path / "node-area"
    write_step(area, 1, 5)
    write_step(area, 1, 10)
    write_step(area, 1, 15, commit=False)  # still being written: not sent
    sender = PeerSender(str(area), "B", ("127.0.0.1", peer.port), RING)
    assert sender.sync_once() == 2
    held = Path(peer.node_folder("B"))
    assert committed_step_folders(str(held)) == {
        "rank-00001/step-000000005",
        "rank-00001/step-000000010",
    }
    assert not (held / "rank-00001" / "step-000000015").exists()

    (area / "rank-00001" / "step-000000015" / "MANIFEST.json").write_text("{}")
    shutil.rmtree(area / "rank-00001" / "step-000000005")  # the node's retention
    assert sender.sync_once() == 1
    assert committed_step_folders(str(held)) == {
        "rank-00001/step-000000010",
        "rank-00001/step-000000015",
    }


def test_a_node_that_lost_its_memory_fetches_every_committed_file_back(
    tmp_path: Path, peer: PeerStore
) -> None:
    area = tmp_path / "node-area"
    write_step(area, 3, 10)
    PeerSender(str(area), "B", ("127.0.0.1", peer.port), RING).sync_once()
    before = {p.relative_to(area): p.read_bytes() for p in area.rglob("*") if p.is_file()}

    fresh = tmp_path / "replacement"
    assert fetch(("127.0.0.1", peer.port), "B", str(fresh), RING) == 3
    after = {p.relative_to(fresh): p.read_bytes() for p in fresh.rglob("*") if p.is_file()}
    assert after == before
    assert fetch(("127.0.0.1", peer.port), "C", str(tmp_path / "other"), RING) == 0, "not C's"


def test_an_unreachable_peer_fetches_nothing_and_says_so(tmp_path: Path, caplog) -> None:
    store = PeerStore(("127.0.0.1", 0), str(tmp_path / "gone"), RING)
    port = store.port
    store.server_close()  # nothing listens there any more
    with caplog.at_level("INFO", logger="checkflow.memory.peer"):
        assert fetch(("127.0.0.1", port), "B", str(tmp_path / "area"), RING) == 0
    assert "no peer at 127.0.0.1" in caplog.text


def test_a_put_whose_path_climbs_out_of_the_peer_area_writes_nothing(
    tmp_path: Path, peer: PeerStore
) -> None:
    message = wire.request(RING, "put", "B", path="../../../escaped", size=3)
    with socket.create_connection(("127.0.0.1", peer.port), timeout=10) as sock:
        sock.sendall(message.line + b"abc")
        assert sock.makefile("rb").readline() == b"", "refused: no ok"
    assert not list(tmp_path.rglob("escaped"))
