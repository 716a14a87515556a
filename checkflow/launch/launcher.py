"""Launch a script the way torchrun does, with checkflow's recovery fixes on top.

torchrun's own parts do the work: ``torch.distributed.run``'s options and
``config_from_args``, and the agent is launched as ``torch.distributed.launcher.api``'s
``launch_agent`` does. What changes:

- the rendezvous backend is wrapped (:mod:`checkflow.launch.rendezvous`) so every restart
  bootstraps from a fresh store and reconnects;
- workers that do not exit within ``--shutdown-timeout`` (default :data:`SHUTDOWN_GRACE`
  instead of torch's 30 s) are SIGKILLed: a frozen process never obeys SIGTERM, and a
  restart waits for it;
- the coordinator settings are exported to the workers (:mod:`checkflow.client.env`),
  with a token for this job only in place of the admin token (:mod:`.jobtoken`);
- the agent is :class:`~checkflow.launch.agent.CheckflowAgent`, which follows the job at
  the coordinator, reports crashes to it, and restarts its workers when the job moved on;
- with ``--ram-tier`` the agent owns the node's RAM-tier folder (:mod:`checkflow.memory`):
  it creates it, exports it to the workers (``CHECKFLOW_RAM_DIR``), keeps it across their
  restarts, and removes it when the job ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from checkflow.client import env
from checkflow.client.env import CoordinatorSettings
from checkflow.launch import jobtoken, rendezvous, world
from checkflow.memory import area

if TYPE_CHECKING:
    from checkflow.launch.agent import CheckflowAgent
    from checkflow.launch.warm import WarmPool
    from checkflow.launch.watch import CoordinatorWatch

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE = 5
"""Seconds a worker gets to exit after SIGTERM before SIGKILL, unless set."""


def torchrun_parser() -> argparse.ArgumentParser:
    """torchrun's own argument parser (``torch.distributed.run``), imported lazily."""
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def launch(args: argparse.Namespace, coordinator: CoordinatorSettings) -> None:
    """Run ``args.training_script`` under the elastic agent until it succeeds or fails.

    Args:
        args: torchrun's options, as its parser fills them.
        coordinator: exported to every worker (and its restarts).

    Raises:
        torch.distributed.elastic.multiprocessing.errors.ChildFailedError: the workers
            failed more often than ``--max-restarts`` allows.
        WorldMismatch: the workers do not form the world launched (``launch.world``).
        SignalException: the agent got SIGINT or SIGTERM; the workers were stopped.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import config_from_args

    from checkflow.launch.warm import WarmPool

    _resolve_rendezvous(args)
    config, cmd, cmd_args = config_from_args(args)
    config.rdzv_backend = _wrapped(config.rdzv_backend)
    # torch <= 2.9 has no --shutdown-timeout (nor the setting): the grace applies there too.
    given = getattr(args, "shutdown_timeout", None)
    if given is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        config.shutdown_timeout = SHUTDOWN_GRACE
    # Workers inherit the agent's environment (torch's SubprocessHandler copies os.environ);
    # they and the agent's crash reports get a token for this job only (launch/jobtoken.py).
    workers = jobtoken.for_workers(coordinator)
    os.environ.update(workers.as_env())
    # torch's c10d handler keeps, per agent, the shared store of the round it first joined:
    # an agent that was rank 0 never publishes its address again, so a node that replaces a
    # dead one waits for it until its read timeout. Off, it bootstraps every round afresh.
    os.environ[rendezvous.TORCH_SHARED_STORE_OFF] = "1"
    rendezvous.register()
    warm = WarmPool(args.warm_imports.split(",")) if args.warm_restarts else None
    config.run_id = config.run_id or str(uuid.uuid4().int)  # names the RAM-tier folder
    job = coordinator.job or config.run_id or "job"
    ring = ram_ring(args, coordinator, job)  # the token given: the same on every node
    ram = ram_area(args, job)
    peers = ram_peers(args, ram, ring) if ram is not None else []
    try:
        run_agent(config, cmd, list(cmd_args), workers, warm, ram_dir=ram)
    except SignalException:
        # Stopped by a signal, the job is not over (the agent may be started again here):
        # its ranks' RAM copies stay for the next agent. Any other end frees the memory.
        ram = None
        raise
    finally:
        for service in peers:
            service.close()
        if ram is not None:
            area.remove(ram)


def ram_ring(args: argparse.Namespace, coordinator: CoordinatorSettings, job: str) -> Any:
    """The peer ring's signing key (a ``checkflow.memory.wire.RingKey``) for ``job``, from
    ``--ram-secret-file`` or else the coordinator token; None without ``--ram-listen`` and
    ``--ram-peer``.

    Raises:
        NoSecretError: a ring is asked for and there is no secret (a ring without one would
            let anyone who reaches its port read, drop or plant a node's copies).
    """
    if not getattr(args, "ram_tier", False) or not (args.ram_listen or args.ram_peer):
        return None
    from checkflow.memory import wire

    secret = wire.read_secret(getattr(args, "ram_secret_file", None), coordinator.token)
    return wire.RingKey.derive(secret, job)


def ram_area(args: argparse.Namespace, job: str) -> str | None:
    """With ``--ram-tier``: create this node's RAM-tier folder and export it to the workers.

    It is ``<--ram-root>/<job>/<node>``: the job is the coordinator's job name, else the
    rendezvous id; the node is ``CHECKFLOW_RAM_NODE``, else the host name. Its folders are
    this user's, mode 0700 (``area.create``).

    Raises:
        UnsafeFolderError: one of them exists and another user owns it or can write it.
    """
    if not getattr(args, "ram_tier", False):
        return None
    path = area.create(area.node_area(args.ram_root, job, area.node_name()), args.ram_root)
    os.environ[area.RAM_DIR] = path  # workers inherit the agent's environment
    logger.info("checkflow: RAM tier of this node in %s", path)
    return path


def ram_peers(args: argparse.Namespace, ram: str, ring: Any) -> list[Any]:
    """``--ram-listen``: hold the predecessor's copies; ``--ram-peer``: first fetch this
    node's copies back when its memory holds none (a replaced node), then send them there.
    Every message is signed with ``ring`` (:func:`ram_ring`)."""
    from checkflow.memory import peer

    services: list[Any] = []
    if ring is None:
        return services
    if args.ram_listen:
        services.append(peer.PeerStore(peer.parse_address(args.ram_listen), ram, ring).start())
    if args.ram_peer:
        successor = peer.parse_address(args.ram_peer)
        node = area.node_name()
        if not peer.committed_step_folders(ram):
            peer.fetch(successor, node, ram, ring)
        services.append(peer.PeerSender(ram, node, successor, ring).start())
    return services


def run_agent(
    config: Any,
    entrypoint: Any,
    args: list[str],
    coordinator: CoordinatorSettings,
    warm: WarmPool | None = None,
    ram_dir: str | None = None,
) -> None:
    """torch's ``launch_agent`` (``torch.distributed.launcher.api``) with checkflow's agent.

    Args:
        config: torch's ``LaunchConfig``.
        entrypoint: the command the workers run (``sys.executable`` for a script).
        args: its arguments.
        coordinator: followed by the agent when set.
        warm: where restarted workers come from (cold starts when None); closed here.
        ram_dir: the node's RAM-tier folder (``--ram-tier``): see ``agent.JIT_GRACE_S``.

    Raises:
        ChildFailedError: the workers failed more often than ``config.max_restarts`` allows.
        WorldMismatch: the workers do not form the world launched (``launch.world``).
    """
    from torch.distributed.elastic import metrics
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from checkflow.launch.watch import CoordinatorWatch, watching

    if hasattr(config, "signals_to_handle"):  # torch <= 2.9 has no such setting
        os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = worker_spec(config, entrypoint, args)
    watch = CoordinatorWatch(coordinator) if coordinator.url else None
    claims_dir = world.claims_folder()
    agent = _agent(config, spec, watch, warm, ram_dir, claims_dir)
    shutdown_rdzv = True
    try:
        with watching(watch):  # a stop (Ctrl-C, restarts used up) is reported to it
            metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
            result = agent.run()
            if result.is_failed():
                raise ChildFailedError(name=_script(args), failures=result.failures)
    except SignalException:
        # Closing the rendezvous here would close it for good: other nodes could not rejoin.
        shutdown_rdzv = False
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        for part in (watch, warm):  # the coordinator's watch, the spare workers
            if part is not None:
                part.close()
        shutil.rmtree(claims_dir, ignore_errors=True)


def _agent(
    config: Any,
    spec: Any,
    watch: CoordinatorWatch | None,
    warm: WarmPool | None,
    ram_dir: str | None,
    claims_dir: str,
) -> CheckflowAgent:
    """The agent of ``run_agent``, with torch's settings from ``config`` (``LaunchConfig``)."""
    from checkflow.launch.agent import CheckflowAgent

    return CheckflowAgent(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=getattr(config, "shutdown_timeout", SHUTDOWN_GRACE),
        watch=watch,
        warm=warm,
        ram_dir=ram_dir,
        claims_dir=claims_dir,
    )


def worker_spec(config: Any, entrypoint: Any, args: list[str]) -> Any:
    """torch's ``WorkerSpec`` for ``config`` (a ``LaunchConfig``), as ``launch_agent`` builds
    it, with the rendezvous handler of ``config.rdzv_backend``."""
    import torch.distributed.elastic.rendezvous.registry as rdzv_registry
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    config.run_id = config.run_id or str(uuid.uuid4().int)
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    return WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        **_newer_spec_settings(config),
    )


NEWER_SPEC_SETTINGS = (
    "numa_options",
    "duplicate_stdout_filters",
    "duplicate_stderr_filters",
    "virtual_local_rank",
)
"""``WorkerSpec`` settings that older torch lacks (2.9, which torch_xla 2.9 needs, has only
``numa_options``): passed where ``LaunchConfig`` has them."""


def _newer_spec_settings(config: Any) -> dict[str, Any]:
    return {name: getattr(config, name) for name in NEWER_SPEC_SETTINGS if hasattr(config, name)}


def _script(args: list[str]) -> str:
    """The script's name among the interpreter's arguments (``-u train.py ...``)."""
    return next((a for a in args if not a.startswith("-")), "")


def _resolve_rendezvous(args: argparse.Namespace) -> None:
    """torchrun's ``run()`` defaults: ``--standalone`` and a lone node mean c10d on localhost."""
    from torch.distributed.run import parse_min_max_nnodes

    single_node = parse_min_max_nnodes(args.nnodes)[1] == 1
    if args.standalone or (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and single_node
    ):
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _wrapped(backend: str) -> str:
    if backend not in rendezvous.BACKENDS:
        logger.warning(
            "rendezvous backend %r is not one checkflow wraps (%s); its restarts may reuse "
            "the agent's store (see README, 'Launching with checkflow run')",
            backend,
            ", ".join(rendezvous.BACKENDS),
        )
        return backend
    return rendezvous.PREFIX + backend


def coordinator_settings(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> CoordinatorSettings:
    """``--coordinator/--job/--token``, each falling back to its ``CHECKFLOW_*`` variable."""
    return env.resolve(args.coordinator, args.job, args.token, environ)
