"""A rendezvous whose every round gives the workers a store of their own.

Why: by default torch's c10d rendezvous lets the workers bootstrap from the agent's
*shared* TCPStore (``use_agent_store``), which outlives restarts and has no per-round
prefix (``torch.distributed.rendezvous._create_c10d_store``: "We create a new TCPStore for
every retry so no need to add prefix" -- but it is a new *client* of the same server).
The keys gloo's full-mesh connect reads (``default_pg/0//cpu//0/<rank>``: each rank's
listening address) therefore survive a restart, and a restarted rank can read its peer's
*previous* address before the peer publishes the new one: ``connectFullMesh`` fails with
"connection refused" or hangs. ``benchmarks/torchrun_restart.py`` shows it.

:class:`FreshStorePerRound` wraps torch's own handler and does per round what
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` does: ``use_agent_store`` is False, so worker
rank 0 hosts a new TCPStore on a free port that the agents agree on through the round's
store. Nothing from an earlier round can be read. Backends register as ``checkflow-<name>``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

logger = logging.getLogger(__name__)

PREFIX = "checkflow-"
BACKENDS = ("c10d", "static", "etcd", "etcd-v2")
"""torch's backends that :func:`register` wraps."""
TORCH_SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""torch's switch (read by its c10d handler in every round); the launcher sets it to 1."""
BOOTSTRAP_KEYS = "checkflow/bootstrap"
"""Prefix of the keys under which rank 0 publishes the workers' store address."""
_PER_ROUND_STORE = ("c10d", "etcd", "etcd-v2")
"""Backends whose ``next_rendezvous`` store is already prefixed with the round number."""


class FreshStorePerRound(RendezvousHandler):
    """torch's handler ``inner``, except that workers never bootstrap from a reused store."""

    def __init__(self, inner: RendezvousHandler, backend: str) -> None:
        self._inner = inner
        self._backend = backend
        self._round = 0

    def get_backend(self) -> str:
        return PREFIX + self._backend

    @property
    def use_agent_store(self) -> bool:
        # False: the workers' rank 0 hosts the store (``_create_c10d_store``), fresh per round.
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        store = info.store
        if self._backend not in _PER_ROUND_STORE:
            # The static backend returns the same store every round; all its agents restart
            # together, so counting rounds here agrees across them.
            store = PrefixStore(f"checkflow/round-{self._round}", store)
        self._round += 1
        # Rank 0 picks a free port and publishes it in this round's keys; all agents read it.
        # Under keys of our own: torch's c10d handler has already published its shared
        # store's address under ``MASTER_ADDR``/``MASTER_PORT`` of the same round store, and
        # another node reading those before rank 0 overwrites them bootstraps elsewhere
        # (its workers then wait for peers that never come: "1/2 clients joined").
        keys = PrefixStore(BOOTSTRAP_KEYS, store)
        bootstrap = RendezvousStoreInfo.build(info.rank, keys, local_addr=self._local_addr())
        logger.info(
            "rendezvous round %d: workers bootstrap from a new store at %s:%d",
            self._round,
            bootstrap.master_addr,
            bootstrap.master_port,
        )
        return RendezvousInfo(store, info.rank, info.world_size, bootstrap)

    def _local_addr(self) -> str | None:
        node = getattr(self._inner, "_this_node", None)  # the c10d handler's own address
        return getattr(node, "addr", None)

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def register() -> None:
    """Register ``checkflow-<backend>`` for every backend of :data:`BACKENDS`; idempotent."""
    for backend in BACKENDS:
        rendezvous_handler_registry.register(PREFIX + backend, _creator(backend))


def _creator(backend: str) -> Callable[[Any], Any]:
    """The registry's ``RendezvousHandlerCreator`` for ``backend`` (one per backend)."""
    return _CREATORS.setdefault(backend, lambda params: _create(backend, params))


_CREATORS: dict[str, Callable[[Any], Any]] = {}
"""One creator per backend, so that registering twice registers the same callable."""


def _create(backend: str, params: RendezvousParameters) -> FreshStorePerRound:
    inner_params = RendezvousParameters(
        backend=backend,
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        local_addr=params.local_addr,
        **params.config,
    )
    return FreshStorePerRound(rendezvous_handler_registry.create_handler(inner_params), backend)
