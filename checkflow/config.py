"""``CheckpointConfig``: how a ``Checkpointer`` checkpoints, checked before anything runs.

Every bad value or combination is refused in ``__post_init__`` with the argument's name, so a
typo fails when the ``Checkpointer`` is built, not at the first checkpoint hours into a run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from checkflow.client import endpoints, env

WHEN_BUSY = ("wait", "skip")
"""What a due checkpoint does when both host buffer sets are still being persisted."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Every option of a ``Checkpointer`` except where (``uri``), what (``state``) and the
    process group.

    Raises:
        ValueError: a value out of range or a bad combination; the message names the argument.
    """

    every: int | str = "auto"
    """Checkpoint every N steps, or ``"auto"`` (CheckFreq): measure the step time and what a
    checkpoint costs, then pick the smallest interval whose overhead stays under
    ``max_overhead`` and that lets each persist finish in time."""
    max_overhead: float = 0.035
    """Fraction of training time checkpoints may take, in (0, 1] (``every="auto"``)."""
    codec: str | Mapping[str, str] = "exact"
    """A codec name for every tensor, or ``{glob on fqn: name}`` (first match wins)."""
    keep: int = 3
    """Committed checkpoints to retain, or zero to retain all."""
    rng: bool = True
    """Also save and restore the torch, CUDA, numpy and Python RNG states."""
    coordinator: str | None = None
    """URL of a checkflow coordinator, or several replicas' comma-separated
    (``http://a:8470,http://b:8470``: tried in order, failing over); needs ``job``."""
    job: str | None = None
    """The job's name on the coordinator."""
    full_every: int = 10
    """With incremental codecs, a full checkpoint at least every N deltas (N >= 1)."""
    when_busy: str = "wait"
    """A due checkpoint whose host buffer sets are all still being persisted ``"wait"``s for
    one (every due checkpoint is taken; the wait is counted in ``stats.waits`` and
    ``stats.waited_s``) or, as an explicit opt-in, ``"skip"``s (the next due step tries again)."""
    storage_options: dict[str, Any] | None = None
    """Passed to fsspec (credentials, endpoint)."""
    token: str | None = None
    """Bearer token for the coordinator."""
    hang_timeout: float | None = None
    """Seconds a rank's step may stand still before the coordinator declares it hung and
    the job restarts; None: the coordinator's default (``checkflow serve --hang-timeout``),
    else derived from the step times. Wrap known long pauses in ``ckpt.paused()``."""
    allow_pickle: bool = False
    """Store state values that are not data (see ``checkflow.objects``) as pickles instead of
    refusing them at the first checkpoint. Loading such a checkpoint then needs
    ``trust=True``, since unpickling runs code."""
    ram_dir: str | None = None
    """The node's RAM-tier folder (``checkflow.memory``): each checkpoint is written there
    first (this rank's whole state, ``exact``), then to storage, and a restart reads it back
    from there. Default: ``CHECKFLOW_RAM_DIR``, which ``checkflow run --ram-tier`` exports;
    None and unset: no RAM tier."""
    ram_keep: int = 2
    """Newest steps the RAM tier retains (1 or 2; each is one more copy of the rank's state
    in node memory)."""
    ram_every: int | None = None
    """With a RAM tier, also checkpoint every N steps to it alone (e.g. 1: every step), while
    storage keeps ``every``; None: the RAM tier takes the storage checkpoints only."""
    jit: bool = False
    """Declare the ranks data-parallel replicas (DDP: every rank's state the same) and, with
    a RAM tier, write a just-in-time checkpoint of the current step there when the job
    fails, which a restarted rank that lacks it reads from a survivor's copy
    (``checkflow.memory.jit``): at most one step is redone. Refused for sharded state."""

    def __post_init__(self) -> None:
        if self.every != "auto" and not _is_int(self.every, minimum=1):
            raise ValueError(f"every must be a positive int or 'auto', got {self.every!r}")
        if not _is_number(self.max_overhead) or not 0 < self.max_overhead <= 1:
            raise ValueError(f"max_overhead must be in (0, 1], got {self.max_overhead!r}")
        if not _is_int(self.keep, minimum=0):
            raise ValueError(f"keep must be >= 0 (0 keeps every checkpoint), got {self.keep!r}")
        if not _is_int(self.full_every, minimum=1):
            raise ValueError(f"full_every must be >= 1, got {self.full_every!r}")
        if self.when_busy not in WHEN_BUSY:
            raise ValueError(f"when_busy must be one of {WHEN_BUSY}, got {self.when_busy!r}")
        if self.coordinator is not None and not self.job:
            raise ValueError("coordinator= needs job= (the job's name on the coordinator)")
        if self.coordinator is not None:
            endpoints.parse(self.coordinator)  # a ValueError naming the bad item
        if self.hang_timeout is not None and (
            not _is_number(self.hang_timeout) or not 0.1 <= self.hang_timeout <= 1e9
        ):
            raise ValueError(
                f"hang_timeout must be seconds in [0.1, 1e9] or None, got {self.hang_timeout!r}"
            )
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise ValueError(
                f"storage_options must be a dict of fsspec options, got {self.storage_options!r}"
            )
        if self.ram_every is not None and not _is_int(self.ram_every, minimum=1):
            raise ValueError(f"ram_every must be a positive int or None, got {self.ram_every!r}")
        if self.ram_keep not in (1, 2):
            raise ValueError(f"ram_keep must be 1 or 2, got {self.ram_keep!r}")
        _check_codec(self.codec)

    @property
    def auto(self) -> bool:
        """True when the interval is tuned (``every="auto"``)."""
        return self.every == "auto"


def _is_int(value: object, *, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_codec(codec: str | Mapping[str, str]) -> None:
    """Unknown codec names fail here, listing the valid ones (``CodecRules`` checks them)."""
    if not isinstance(codec, str | Mapping):
        raise ValueError(f"codec must be a codec name or {{glob: name}}, got {codec!r}")
    from checkflow.codec import CodecRules  # the codec registry imports torch

    CodecRules(codec)


def from_arguments(given: Mapping[str, Any], config: CheckpointConfig | None) -> CheckpointConfig:
    """The ``Checkpointer``'s options: ``config``, or its keyword arguments (``given``: its
    ``locals()``; every field of ``CheckpointConfig`` is one, by name: a field without its
    keyword argument fails here at once, with a KeyError, not silently).

    Raises:
        TypeError: both ``config`` and keyword options were given.
    """
    options = CheckpointConfig(**{f.name: given[f.name] for f in fields(CheckpointConfig)})
    if config is not None and options != CheckpointConfig():
        raise TypeError("pass the options either as config= or as keyword arguments, not both")
    return config if config is not None else options


def with_launcher_settings(
    config: CheckpointConfig, environ: Mapping[str, str] | None = None
) -> CheckpointConfig:
    """``config`` with each coordinator setting it lacks taken from the environment.

    ``checkflow run --coordinator URL --job NAME`` exports ``CHECKFLOW_COORDINATOR``,
    ``CHECKFLOW_JOB`` and ``CHECKFLOW_TOKEN`` to its workers, so a training script needs no
    coordinator arguments of its own (as torchrun's workers read ``MASTER_ADDR``). Each
    setting resolves on its own (:func:`checkflow.client.env.resolve`): the argument given to
    the ``Checkpointer``, else its variable, else None. So a script that passes
    ``coordinator=`` and ``job=`` still sends the ``CHECKFLOW_TOKEN`` of its environment.

    Raises:
        ValueError: only one of the coordinator's URL and its job resolves.
    """
    settings = env.resolve(config.coordinator, config.job, config.token, environ)
    if (settings.url, settings.job, settings.token) == (
        config.coordinator,
        config.job,
        config.token,
    ):
        return config  # nothing filled in: the caller's own object
    return replace(config, coordinator=settings.url, job=settings.job, token=settings.token)
