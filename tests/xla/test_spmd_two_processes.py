"""Why the SPMD tests split one process's mesh into stand-in hosts: torch_xla 2.9's PJRT
CPU client cannot span processes.

Two real processes, started with everything a multi-host launch sets (ranks, world size,
the coordinator address and port), each with 2 virtual CPU devices: each sees one process
(itself) and its own 2 devices, and a mesh over the 4 devices of both fails. torch_xla 2.9
creates the CPU client from ``CPU_NUM_DEVICES`` alone (``GetTfrtCpuClient(async,
cpu_device_count)``: no process id, no key-value store), unlike its CUDA and TPU clients.

When this test fails, torch_xla's CPU backend has learned to span processes: replace the
stand-in hosts (``test_spmd_hosts``, ``test_spmd_host_reads``) with real processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.net import free_port

SCRIPT = Path(__file__).with_name("_spmd_two_processes.py")


def test_pjrt_cpu_processes_do_not_share_one_spmd_mesh() -> None:
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PJRT_DEVICE": "CPU",
            "CPU_NUM_DEVICES": "2",
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2",
            "PJRT_LOCAL_PROCESS_RANK": str(rank),
            "PJRT_LOCAL_PROCESS_COUNT": "2",
            "MASTER_ADDR": "127.0.0.1",
            "XLA_COORDINATOR_PORT": port,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        report = json.loads(out.strip().splitlines()[-1])
        assert report["process_count"] == 1 and report["process_index"] == 0
        assert report["global_devices"] == report["addressable_devices"] == 2
        assert report["mesh_error"] == (
            "AssertionError: Number of device IDs (4) must match the global number of devices (2)"
        )
