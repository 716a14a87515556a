"""URL paths of the coordinator API: the templates the server routes on, and the filled-in
paths the clients request, from one list.

Templates use FastAPI's ``{name}`` placeholders relative to :data:`PREFIX`; :func:`path`
fills them in (quoting each value) and prepends the prefix.
"""

from __future__ import annotations

import re
from urllib.parse import quote

API_VERSION = "v1"
PREFIX = f"/{API_VERSION}"

JOBS = "/jobs"
JOB = "/jobs/{job}"
JOB_TOKENS = "/jobs/{job}/tokens"
RESTORE_POINT = "/jobs/{job}/restore-point"
RECOVER = "/jobs/{job}/recover"
EVENTS = "/jobs/{job}/events"
STOP = "/jobs/{job}/stop"
RANKS = "/jobs/{job}/ranks"
REGISTER = "/jobs/{job}/ranks/{rank}/register"
RANK_HEARTBEAT = "/jobs/{job}/ranks/{rank}/heartbeat"
NODE_HEARTBEAT = "/jobs/{job}/nodes/{node}/heartbeat"
FINISH = "/jobs/{job}/ranks/{rank}/finish"
FAILURE = "/jobs/{job}/ranks/{rank}/failure"
RESTORED = "/jobs/{job}/ranks/{rank}/restored"
RETENTION = "/jobs/{job}/ranks/{rank}/retention"
CHECKPOINTS = "/jobs/{job}/checkpoints"
PART = "/jobs/{job}/checkpoints/{step}/ranks/{rank}"
COMMIT = "/jobs/{job}/checkpoints/{step}/commit"


def path(template: str, **values: str | int) -> str:
    """The request path of ``template`` with ``values`` filled in, e.g.
    ``path(REGISTER, job="run-1", rank=3) == "/v1/jobs/run-1/ranks/3/register"``."""
    return PREFIX + template.format(**{k: quote(str(v), safe="") for k, v in values.items()})


def pattern(template: str) -> re.Pattern[str]:
    """A regex matching request paths of ``template``; one group per placeholder."""
    parts = re.split(r"\{\w+\}", PREFIX + template)
    return re.compile("^" + "([^/]+)".join(map(re.escape, parts)) + "$")
