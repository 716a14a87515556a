"""Constrained field types of the coordinator API, shared by requests and replies."""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field

MAX_INT = 2**53 - 1
"""Largest integer accepted: beyond it, JSON numbers parsed as doubles stop being exact."""
MAX_RANK = 2**31
"""Largest rank accepted (in bodies and in URL paths)."""
MAX_NODE_NAME = 256
"""Longest node (host) name accepted in a URL path."""
MAX_SECONDS = 1e9
"""Largest duration accepted: a measurement beyond it is a bug, not a slow step."""


def _no_bool(value: object) -> object:
    # JSON true/false is not a number, although Python's bool is an int.
    if isinstance(value, bool):
        raise ValueError("a number is required, not a boolean")
    return value


NoBool = BeforeValidator(_no_bool)

JobName = Annotated[
    str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="Job name.")
]
# NoBool after Field: the other way round, the bounds leave the JSON schema.
Step = Annotated[
    int, Field(ge=0, le=MAX_INT, description="Training step (completed steps)."), NoBool
]
Generation = Annotated[int, Field(ge=0, le=MAX_INT), NoBool]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS, allow_inf_nan=False), NoBool]
RankId = Annotated[int, Field(ge=0, le=MAX_RANK), NoBool]
DetailValue = str | int | float | bool | None
