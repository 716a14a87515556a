"""Launch a script the way torchrun does, with checkflow's recovery fixes on top.

torchrun's own parts do the work: ``torch.distributed.run``'s options and
``config_from_args``, ``elastic_launch`` and its ``LocalElasticAgent``. What changes:

- the rendezvous backend is wrapped (:mod:`checkflow.launch.rendezvous`) so every restart
  bootstraps from a fresh store and reconnects;
- workers that do not exit within ``--shutdown-timeout`` (default :data:`SHUTDOWN_GRACE`
  instead of torch's 30 s) are SIGKILLed: a frozen process never obeys SIGTERM, and a
  restart waits for it;
- the coordinator settings are exported to the workers (:mod:`checkflow.client.env`).
"""

from __future__ import annotations

import argparse
import logging
import os
import uuid
from collections.abc import Mapping

from checkflow.client import env
from checkflow.client.env import CoordinatorSettings
from checkflow.launch import rendezvous

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
    """
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    _resolve_rendezvous(args)
    config, cmd, cmd_args = config_from_args(args)
    config.rdzv_backend = _wrapped(config.rdzv_backend)
    if args.shutdown_timeout is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        config.shutdown_timeout = SHUTDOWN_GRACE
    # Workers inherit the agent's environment (torch's SubprocessHandler copies os.environ).
    os.environ.update(coordinator.as_env())
    rendezvous.register()
    elastic_launch(config=config, entrypoint=cmd)(*cmd_args)


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
    return CoordinatorSettings(
        url=args.coordinator or environ.get(env.COORDINATOR) or None,
        job=args.job or environ.get(env.JOB) or None,
        token=args.token or environ.get(env.TOKEN) or None,
    )
