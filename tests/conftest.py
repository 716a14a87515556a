"""Fixtures shared by the whole suite.

S3 is a real S3 HTTP endpoint (moto's server) on 127.0.0.1, started once per session on a
free port and stopped at the end. Nothing here can reach real AWS: the process runs with
fake credentials, no AWS profile or config file, no proxies, and (once the endpoint is up)
``AWS_ENDPOINT_URL_S3`` pointing at moto, so even an ``s3://`` URI opened without
``storage_options`` lands on moto.

Use it like this::

    def test_save_to_s3(s3_uri):                  # a fresh, empty bucket per test
        uri, storage_options = s3_uri             # "s3://checkflow-1a2b3c4d/run", {...}
        Storage(uri, storage_options=storage_options)
        subprocess.run([...], env={**os.environ, **s3_uri.env})   # children find moto too

Fixtures:
    s3_endpoint: ``"http://127.0.0.1:<port>"`` of the session's moto server.
    s3_bucket: a new, empty bucket name for this test.
    s3_uri: an :class:`S3Location` (``uri``, ``storage_options``, ``env``) in a new bucket.
    s3_fault_proxy: a :class:`FaultyS3Proxy` in front of moto that fails the requests a
        test asks it to (``s3_fault_proxy.fail("PUT", times=2, status=503)``).
    faulty_s3: an :class:`S3Location` in a new bucket whose endpoint is ``s3_fault_proxy``.
    juicefs_volume: ``(meta URL, folder)`` of a JuiceFS volume for the session.
    juicefs_gateway: a :class:`~tests.support.juicefs.Gateway` serving it as S3 (MinIO's
        gateway code: a second S3 implementation beside moto), started on first use.
    postgres_cluster: a :class:`~tests.support.postgres.Cluster` for the session (Debian's
        PostgreSQL); ``postgres_cluster.new_database()`` is an empty database's URL.
The helpers behind them (``s3_options``, ``S3Location``, ``FaultyS3Proxy``, ``free_port``…)
are in the ``tests.support`` package: import them from there, never from this file.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.juicefs import Gateway, format_volume, start_gateway
from tests.support.moto_server import start_moto
from tests.support.postgres import Cluster, remove_cluster, start_cluster
from tests.support.s3 import (
    FaultyS3Proxy,
    S3Location,
    env_for,
    isolate_from_real_aws,
    s3_options,
)

# At import, before any test module imports boto/s3fs; inherited by every subprocess the
# tests start (ranks, the CLI, the coordinator).
isolate_from_real_aws()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1:<free port> for the whole session."""
    server, endpoint = start_moto()
    os.environ["AWS_ENDPOINT_URL_S3"] = endpoint
    try:
        yield endpoint
    finally:
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)
        server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str) -> str:
    """A new, empty bucket on the session's endpoint."""
    import boto3

    name = f"checkflow-{uuid.uuid4().hex[:12]}"
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3_uri(s3_endpoint: str, s3_bucket: str) -> S3Location:
    """``s3://<new bucket>/run`` with the storage_options and env that reach it."""
    return S3Location(f"s3://{s3_bucket}/run", s3_options(s3_endpoint), env_for(s3_endpoint))


@pytest.fixture
def s3_fault_proxy(s3_endpoint: str) -> Iterator[FaultyS3Proxy]:
    """A :class:`FaultyS3Proxy` in front of the session's endpoint, for this test only."""
    proxy = FaultyS3Proxy(s3_endpoint)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.fixture
def faulty_s3(s3_fault_proxy: FaultyS3Proxy, s3_bucket: str) -> S3Location:
    """A new bucket reached through ``s3_fault_proxy``: ask for both fixtures in a test."""
    endpoint = s3_fault_proxy.endpoint
    return S3Location(f"s3://{s3_bucket}/run", s3_options(endpoint), env_for(endpoint))


@pytest.fixture(scope="session")
def juicefs_volume(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A JuiceFS volume (sqlite metadata, local blocks) for the session's gateways."""
    root = tmp_path_factory.mktemp("juicefs")
    return format_volume(root), root


@pytest.fixture(scope="session")
def juicefs_gateway(juicefs_volume: tuple[str, Path]) -> Iterator[Gateway]:
    """``juicefs gateway`` on 127.0.0.1:<free port> for the whole session."""
    meta, root = juicefs_volume
    gateway = start_gateway(meta, root / "gateway")
    try:
        yield gateway
    finally:
        gateway.stop()


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Cluster]:
    """A real PostgreSQL for the session, the coordinator replicas' database
    (``tests/support/postgres.py``): started on first use, stopped at the end."""
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        remove_cluster(cluster)
