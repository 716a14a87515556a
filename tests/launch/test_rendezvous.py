""":class:`FreshStorePerRound`: every round's workers get a store nothing earlier wrote to.

A fake of torch's static handler (one unprefixed store for every round, as
``StaticTCPRendezvous`` returns) stands in for the agents; the stores are real
``HashStore``s, so the keys read are the keys written.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from checkflow.launch.rendezvous import FreshStorePerRound


class SameStoreEveryRound(RendezvousHandler):
    """Like torch's static rendezvous: the same store, rank and world size every round."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank

    def get_backend(self) -> str:
        return "static"

    def next_rendezvous(self) -> RendezvousInfo:
        return RendezvousInfo(self.store, self.rank, 2, None)  # type: ignore[arg-type]

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "run"

    def shutdown(self) -> bool:
        return True


def test_workers_never_bootstrap_from_the_agents_store():
    handler = FreshStorePerRound(SameStoreEveryRound(dist.HashStore(), 0), "static")
    assert handler.use_agent_store is False
    assert handler.get_backend() == "checkflow-static"


def test_each_round_publishes_a_new_worker_store_address_under_its_own_keys():
    shared = dist.HashStore()
    agent0 = FreshStorePerRound(SameStoreEveryRound(shared, 0), "static")
    agent1 = FreshStorePerRound(SameStoreEveryRound(shared, 1), "static")

    first = [agent0.next_rendezvous(), agent1.next_rendezvous()]
    second = [agent0.next_rendezvous(), agent1.next_rendezvous()]

    for info in first + second:
        assert info.bootstrap_store_info is not None
    ports = [[i.bootstrap_store_info.master_port for i in r] for r in (first, second)]
    assert ports[0][0] == ports[0][1] and ports[1][0] == ports[1][1], "agents agree per round"
    # What round 1 writes cannot be read in round 2: the rounds' stores are disjoint.
    first[0].store.set("default_pg/0//cpu//0/1", b"old address")
    assert not second[1].store.check(["default_pg/0//cpu//0/1"])


def test_a_node_never_reads_the_shared_store_address_torch_published_in_the_same_round():
    """torch's c10d handler publishes its shared store under MASTER_ADDR/MASTER_PORT of the
    round store; a node reading those before rank 0 publishes the fresh store's address
    would bootstrap elsewhere (seen with two agents: "1/2 clients joined")."""
    shared = dist.HashStore()
    shared.set_timeout(timedelta(seconds=10))
    agent0 = FreshStorePerRound(SameStoreEveryRound(shared, 0), "c10d")
    agent1 = FreshStorePerRound(SameStoreEveryRound(shared, 1), "c10d")
    shared.set("MASTER_ADDR", b"torch-shared-store")  # as torch's handler does on rank 0
    shared.set("MASTER_PORT", b"1111")

    node1: list[RendezvousInfo] = []
    reader = threading.Thread(target=lambda: node1.append(agent1.next_rendezvous()))
    reader.start()  # node 1 asks before rank 0 published: it must wait, not read 1111
    time.sleep(0.2)
    info0 = agent0.next_rendezvous()
    reader.join(10)

    (info1,) = node1
    assert info0.bootstrap_store_info.master_port != 1111
    assert info1.bootstrap_store_info.master_port == info0.bootstrap_store_info.master_port
