"""What ``checkflow run`` tells the coordinator when it ends with an exception: a signal
stops the job, anything else fails it (``watch.stop_request``, pure)."""

from __future__ import annotations

import signal

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from checkflow.launch.watch import stop_request
from checkflow.protocol import StopReason


def test_a_signal_stops_the_job_and_anything_else_is_recovery_giving_up() -> None:
    sigint = SignalException("Process 7 got signal: 2", sigval=signal.SIGINT)
    assert stop_request(sigint, 3).reason == StopReason.INTERRUPTED
    assert stop_request(KeyboardInterrupt(), 3).reason == StopReason.INTERRUPTED
    crashed = ProcessFailure(local_rank=0, pid=1234, exitcode=-9, error_file="<none>")
    out_of_restarts = stop_request(ChildFailedError("train.py", {0: crashed}), 4)
    assert (out_of_restarts.reason, out_of_restarts.generation) == (StopReason.GAVE_UP, 4)
    assert out_of_restarts.detail.startswith("ChildFailedError: ")
    assert len(stop_request(RuntimeError("x" * 5000), 1).detail) == 1024
