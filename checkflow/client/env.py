"""The coordinator settings, and the one order every setting resolves in.

``checkflow run --coordinator URL --job NAME`` exports them to its workers; a
``Checkpointer`` (or ``checkflow run`` itself) reads them back with :func:`resolve`: each
setting on its own is the argument when one is given, else its ``CHECKFLOW_*`` variable,
else the default. So ``CHECKFLOW_TOKEN=T python train.py --coordinator URL --job J`` sends T,
and an explicit argument always beats whatever the environment holds. Pure functions of a
mapping, so both sides are testable without a process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from checkflow.client import endpoints

COORDINATOR = "CHECKFLOW_COORDINATOR"
JOB = "CHECKFLOW_JOB"
TOKEN = "CHECKFLOW_TOKEN"


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    """Where a job reports: all None when no coordinator was configured."""

    url: str | None = None
    """Base URL of the coordinator, e.g. ``http://127.0.0.1:8470``, or several replicas'
    comma-separated (checked by :func:`checkflow.client.endpoints.parse`)."""
    job: str | None = None
    """The job's name at the coordinator."""
    token: str | None = None
    """Bearer token, when the coordinator requires one."""

    def __post_init__(self) -> None:
        if (self.url is None) != (self.job is None):
            given, missing = (
                ("--coordinator", "--job") if self.job is None else ("--job", "--coordinator")
            )
            raise ValueError(
                f"{given} is set but {missing} is not; give both (or set {COORDINATOR} "
                f"and {JOB}) so that the workers know which job they belong to"
            )
        if self.url is not None:
            endpoints.parse(self.url)  # BadCoordinatorList, a ValueError naming the item

    def as_env(self) -> dict[str, str]:
        """The variables to export to workers; unset settings are left out."""
        pairs = ((COORDINATOR, self.url), (JOB, self.job), (TOKEN, self.token))
        return {name: value for name, value in pairs if value}


def setting(
    given: str | None, name: str, environ: Mapping[str, str], default: str | None = None
) -> str | None:
    """One setting: ``given`` (an argument), else ``environ[name]``, else ``default``.

    An empty argument or variable counts as not given (``CHECKFLOW_TOKEN=`` does not send an
    empty token)."""
    return given or environ.get(name) or default


def resolve(
    url: str | None,
    job: str | None,
    token: str | None,
    environ: Mapping[str, str] | None = None,
) -> CoordinatorSettings:
    """The coordinator settings from arguments and ``environ`` (``os.environ`` by default),
    each field resolved on its own by :func:`setting`.

    Raises:
        ValueError: one of the URL and the job resolves and the other does not, or the URL
            list is bad (:class:`~checkflow.client.endpoints.BadCoordinatorList`).
    """
    env = os.environ if environ is None else environ
    return CoordinatorSettings(
        url=setting(url, COORDINATOR, env),
        job=setting(job, JOB, env),
        token=setting(token, TOKEN, env),
    )


def coordinator_from_env(environ: Mapping[str, str] | None = None) -> CoordinatorSettings:
    """The settings in ``environ`` (``os.environ`` by default); an empty value counts as unset.

    Raises:
        ValueError: only one of ``CHECKFLOW_COORDINATOR`` and ``CHECKFLOW_JOB`` is set.
    """
    return resolve(None, None, None, environ)
