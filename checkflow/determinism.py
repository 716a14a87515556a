"""How the process that wrote a checkpoint computed, so a resume that cannot be exact says so.

An exact restore brings back every bit of the training state, but a resumed run is bitwise
equal to an uninterrupted one only if it also *computes* the same way. On CPU, torch's
matrix products, BatchNorm and reductions split their work by the intra-op thread count and
round differently with another count: a one-ulp difference in one step grows into every
parameter within a few dozen steps. The same holds for another torch release, another set
of vectorized CPU kernels (AVX2 against AVX-512) and another GPU model.

The one reproduced cause of a resume that was not exact (issue 8 §5: every parameter,
BatchNorm statistic and AdamW moment off, scheduler and data position equal) is a resumed
process with another thread count. ``torchrun`` sets ``OMP_NUM_THREADS=1`` when it starts
several processes per node, so a run started with ``python train.py`` and resumed under
``torchrun`` (or the other way round) computes differently without anyone asking for it.

Each checkpoint records ``environment()``; ``Checkpointer.restore`` compares it with the
current process and warns, naming what differs and what to set, instead of letting the
resumed run drift silently.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch


class ResumeNotExactWarning(UserWarning):
    """The resuming process computes differently from the one that wrote the checkpoint."""


def environment() -> dict[str, Any]:
    """What decides how this process rounds: JSON-ready, stored with every checkpoint."""
    env: dict[str, Any] = {
        "torch": str(torch.__version__),
        "intra_op_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        env["cuda_devices"] = [
            torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())
        ]
    return env


_WHY: dict[str, str] = {
    "intra_op_threads": (
        "CPU kernels (matrix products, BatchNorm, reductions) split their work by thread "
        "count and round differently; set OMP_NUM_THREADS={saved} or call "
        "torch.set_num_threads({saved}) before training (torchrun sets OMP_NUM_THREADS=1 "
        "when it starts several processes per node)"
    ),
    "torch": "kernels change between torch releases; install torch=={saved} to resume exactly",
    "cpu_capability": (
        "other vectorized CPU kernels round differently; ATEN_CPU_CAPABILITY={saved} selects "
        "the same ones where this CPU supports them"
    ),
    "deterministic_algorithms": (
        "torch.use_deterministic_algorithms({saved}) selects other kernels; set it as the "
        "first run did"
    ),
    "cuda_devices": "another GPU model runs other kernels",
}


def differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One sentence per setting that differs, each saying why it matters and what to set.

    Settings the checkpoint did not record (it was written by an older checkflow) are not
    compared: nothing is known about them.
    """
    out = []
    for key, why in _WHY.items():
        if key not in saved or saved[key] == current.get(key):
            continue
        out.append(
            f"{key} was {saved[key]!r} when the checkpoint was written and is "
            f"{current.get(key)!r} now: {why.format(saved=saved[key])}"
        )
    return out


def warn_if_different(saved: Mapping[str, Any], *, step: int, uri: str) -> list[str]:
    """Warn (``ResumeNotExactWarning``) when this process computes differently; the reasons."""
    found = differences(saved, environment())
    if found:
        warnings.warn(
            f"checkpoint step {step} in {uri} was written by a process that computed "
            "differently, so training resumed from it will not be bitwise equal to an "
            "uninterrupted run: " + "; ".join(found),
            ResumeNotExactWarning,
            stacklevel=3,
        )
    return found
