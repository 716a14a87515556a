"""Trade the launcher's token for one that acts on this job only, before workers start.

The coordinator's admin token can fail, roll back or commit any job; a training process
needs none of that. So when ``checkflow run`` is given the admin token, it asks the
coordinator for a job token (``POST /v1/jobs/{job}/tokens``) and exports that one to its
workers as ``CHECKFLOW_TOKEN``; its own crash reports use it too. Given a job token
already (the coordinator answers 403 to the trade), it passes that on unchanged. The
launcher must not fail because the coordinator is down: then it warns and passes the
token it was given.
"""

from __future__ import annotations

import logging

import httpx

from checkflow.client.env import CoordinatorSettings
from checkflow.client.transport import Channel, CoordinatorUnavailable, why
from checkflow.protocol import JobToken, paths

logger = logging.getLogger(__name__)

TIMEOUT_S = 10.0


def for_workers(settings: CoordinatorSettings) -> CoordinatorSettings:
    """``settings`` with the token the workers should hold (see the module docstring)."""
    if settings.url is None or settings.job is None or settings.token is None:
        return settings
    urls = len(settings.url.split(","))  # the launcher's start: each replica gets its time
    channel = Channel(settings.url, settings.token, TIMEOUT_S, budget_s=TIMEOUT_S * urls)
    try:
        path = paths.path(paths.JOB_TOKENS, job=settings.job)
        issued = channel.call("POST", path, None, JobToken)
    except httpx.HTTPStatusError as e:
        if e.response.status_code != 403:  # 403: a job token already, the right one to pass
            logger.warning("checkflow: could not get a job token (%s); workers get yours", why(e))
        return settings
    except CoordinatorUnavailable as e:
        logger.warning("checkflow: coordinator unavailable (%s); workers get your token", e)
        return settings
    finally:
        channel.close()
    return CoordinatorSettings(url=settings.url, job=settings.job, token=issued.token)
