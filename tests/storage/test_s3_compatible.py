"""Retention on two real S3 implementations: moto and the JuiceFS gateway (MinIO's code).

botocore 1.36 stopped sending ``Content-MD5``, which MinIO-family servers require on a batch
delete: there ``keep=`` deleted nothing and ``checkflow gc`` failed with "run gc again"
(fsspec/s3fs#931). Each test here lists the bucket afterwards, raw, with boto3: what is
left on the server is the proof, not what checkflow says about it.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from checkflow import Checkpointer, knobs
from checkflow.manifest import step_dir
from checkflow.storage import Storage
from tests.runtime._models import small_state, train_step
from tests.support.juicefs import Gateway, start_gateway
from tests.support.s3 import s3_options

pytestmark = pytest.mark.s3


@dataclass
class Bucket:
    """A new bucket on one server: its URI, the options and CLI flags that reach it."""

    server: str
    uri: str
    options: dict[str, Any]
    flags: list[str]
    client: Any

    @property
    def name(self) -> str:
        return self.uri.removeprefix("s3://").split("/")[0]

    def keys(self) -> list[str]:
        """Every key under the run, as the server lists it (no checkflow, no cache)."""
        answer = self.client.list_objects_v2(Bucket=self.name, Prefix="run/")
        return sorted(o["Key"] for o in answer.get("Contents", []))

    def steps(self) -> list[str]:
        """The step folders that still have any object (or folder marker) on the server."""
        return sorted({k.split("/")[1] for k in self.keys()})


def _moto(endpoint: str) -> Bucket:
    import boto3

    flags = [f"--storage-option=client_kwargs.endpoint_url={endpoint}"]
    flags += ["--storage-option=key=testing", "--storage-option=secret=testing"]
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    return Bucket("moto", "", s3_options(endpoint), flags, client)


def _juicefs(gateway: Gateway) -> Bucket:
    return Bucket("juicefs", "", gateway.options(), gateway.cli_options(), gateway.client())


def _new_bucket(where: Bucket) -> Bucket:
    name = f"checkflow-{uuid.uuid4().hex[:12]}"
    where.client.create_bucket(Bucket=name)
    return dataclasses.replace(where, uri=f"s3://{name}/run")


@pytest.fixture(params=["moto", "juicefs"])
def bucket(request: pytest.FixtureRequest) -> Bucket:
    """A new, empty bucket on moto, then on the JuiceFS gateway."""
    if request.param == "moto":
        return _new_bucket(_moto(request.getfixturevalue("s3_endpoint")))
    return _new_bucket(_juicefs(request.getfixturevalue("juicefs_gateway")))


def _train(bucket: Bucket, steps: int, **kwargs: Any) -> Checkpointer:
    state = small_state()
    with Checkpointer(bucket.uri, state, every=1, storage_options=bucket.options, **kwargs) as ck:
        for _ in range(steps):
            train_step(state)
            ck.step()
            ck.wait()  # each commit and the retention after it
    return ck


def _gc(bucket: Bucket, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "checkflow.cli", "gc", bucket.uri, *args, *bucket.flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_checkpointer_keep_2_deletes_the_old_steps_on_the_server(bucket: Bucket) -> None:
    ck = _train(bucket, 5, keep=2)
    assert bucket.steps() == [step_dir(4), step_dir(5)]
    assert ck.stats.committed == 5
    assert ck.stats.retention_failures == 0 and ck.stats.retention_error == ""


def test_gc_keep_1_exits_0_and_leaves_exactly_the_newest_step(bucket: Bucket) -> None:
    _train(bucket, 3, keep=0)
    assert bucket.steps() == [step_dir(1), step_dir(2), step_dir(3)]
    res = _gc(bucket, "--keep", "1")
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert "deleted step 1 (full" in res.stdout and "deleted step 2 (" in res.stdout
    assert "kept 1 checkpoint(s): 3" in res.stdout
    assert bucket.steps() == [step_dir(3)]


def test_a_server_refusing_batch_deletes_gets_one_delete_per_object(
    juicefs_gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    # Without the MD5 (as s3fs sends it today) the gateway refuses DeleteObjects: the
    # objects then go one request each, and later deletes skip the batch.
    where = _new_bucket(_juicefs(juicefs_gateway))
    storage = Storage(where.uri, storage_options=where.options)
    for step in (1, 2):
        for part in ("MANIFEST.json", "rank-00000.chunks", "sub/rank-00001.chunks"):
            storage.put(f"{step_dir(step)}/{part}", [b"x" * 10])
    with knobs.override(CHECKFLOW_S3_DELETE_MD5=0), caplog.at_level(logging.WARNING):
        storage.delete(step_dir(1))
        assert where.steps() == [step_dir(2)]
        storage.delete(step_dir(2))
    assert where.keys() == []
    refused = [r.getMessage() for r in caplog.records if "refuses batch deletes" in r.getMessage()]
    assert len(refused) == 1 and "MissingContentMD5" in refused[0]


def test_gc_against_a_read_only_gateway_exits_2_and_does_not_ask_to_retry(
    juicefs_gateway: Gateway, juicefs_volume: tuple[str, Path]
) -> None:
    # A read-only JuiceFS gateway answers every delete 204 and keeps the objects: gc must
    # see that they stay, and say so once, instead of "deleted" or "run gc again".
    where = _new_bucket(_juicefs(juicefs_gateway))
    _train(where, 2, keep=0)
    meta, root = juicefs_volume
    read_only = start_gateway(meta, root / f"read-only-{where.name}", read_only=True)
    try:
        res = _gc(dataclasses.replace(where, flags=read_only.cli_options()), "--keep", "1")
    finally:
        read_only.stop()
    assert res.returncode == 2, res.stderr
    assert res.stderr == (
        f"checkflow: error: could not delete step(s) 1: delete {where.uri}/{step_dir(1)}/"
        f"MANIFEST.json failed: the store answered but kept 1 object(s) ({where.name}/run/"
        f"{step_dir(1)}/MANIFEST.json…): a read-only endpoint, or credentials without delete "
        f"rights; use an endpoint and credentials that may delete under {where.uri}; the store "
        "refuses it, so running gc again will not help until that is fixed (every kept "
        "checkpoint still reads)\n"
    )
    assert res.stdout == "kept 1 checkpoint(s): 2\n"
    assert where.steps() == [step_dir(1), step_dir(2)]


def test_gc_after_transient_failures_exits_1_and_asks_to_run_it_again(
    s3_uri: Any, faulty_s3: Any, s3_fault_proxy: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every batch delete answered 500 (through the fault proxy in front of moto): that may
    # pass later, so here, and only here, gc says to run it again.
    from checkflow.cli import main

    where = _moto(s3_fault_proxy.upstream)
    _train(dataclasses.replace(where, uri=s3_uri.uri), 2, keep=0)
    s3_fault_proxy.fail("POST", times=1000, status=500)  # s3fs itself does not retry a 500
    flags = [f"--storage-option=client_kwargs.endpoint_url={s3_fault_proxy.endpoint}"]
    flags.append("--storage-option=config_kwargs.retries.total_max_attempts=1")  # botocore's
    assert main(["gc", faulty_s3.uri, "--keep", "1", *flags]) == 1
    out, err = capsys.readouterr()
    assert out == "kept 1 checkpoint(s): 2\n"
    assert err.startswith(f"checkflow: error: could not delete step(s) 1 (delete {s3_uri.uri}/")
    assert err.endswith("the store failed transiently: run gc again\n")
    assert s3_fault_proxy.count("POST") == 5  # Storage's retries, then it gave up
