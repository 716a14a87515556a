"""The coordinator settings a launcher hands to its workers through the environment.

``checkflow run --coordinator URL --job NAME --token T`` exports them; a ``Checkpointer``
built without its own ``coordinator=``/``job=``/``token=`` reads them back with
:func:`coordinator_from_env`. Pure functions of a mapping, so both sides are testable
without a process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

COORDINATOR = "CHECKFLOW_COORDINATOR"
JOB = "CHECKFLOW_JOB"
TOKEN = "CHECKFLOW_TOKEN"


@dataclass(frozen=True, slots=True)
class CoordinatorSettings:
    """Where a job reports: all None when no coordinator was configured."""

    url: str | None = None
    """Base URL of the coordinator, e.g. ``http://127.0.0.1:8470``."""
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

    def as_env(self) -> dict[str, str]:
        """The variables to export to workers; unset settings are left out."""
        pairs = ((COORDINATOR, self.url), (JOB, self.job), (TOKEN, self.token))
        return {name: value for name, value in pairs if value}


def coordinator_from_env(environ: Mapping[str, str] | None = None) -> CoordinatorSettings:
    """The settings in ``environ`` (``os.environ`` by default); an empty value counts as unset.

    Raises:
        ValueError: only one of ``CHECKFLOW_COORDINATOR`` and ``CHECKFLOW_JOB`` is set.
    """
    env = os.environ if environ is None else environ
    return CoordinatorSettings(
        url=env.get(COORDINATOR) or None,
        job=env.get(JOB) or None,
        token=env.get(TOKEN) or None,
    )
