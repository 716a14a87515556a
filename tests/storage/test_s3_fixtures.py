"""The S3 fixtures other tests rely on: a child process and an option-less URI reach moto."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

from checkflow.storage import Storage
from tests.support.paths import REPO

pytestmark = pytest.mark.s3

_CHILD = """
import sys
from checkflow.storage import Storage
s = Storage(sys.argv[1], retries=1)
s.put("from-child.bin", [s.read("from-parent.bin"), b" and back"])
"""


@pytest.mark.slow  # a fresh interpreter importing torch: several seconds
def test_a_subprocess_with_s3_uri_env_reaches_the_same_bucket(s3_uri: Any) -> None:
    uri, options = s3_uri
    Storage(uri, storage_options=options).put("from-parent.bin", [b"there"])
    # The child gets no storage_options: the endpoint and credentials come from env.
    env = {**os.environ, **s3_uri.env, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", _CHILD, uri], env=env, check=True, timeout=120)
    assert Storage(uri, storage_options=options).read("from-child.bin") == b"there and back"


def test_an_s3_uri_without_storage_options_lands_on_moto(s3_uri: Any) -> None:
    # AWS_ENDPOINT_URL_S3 points at moto for the session, so a test that forgets the
    # options still cannot touch real S3.
    uri, options = s3_uri
    Storage(uri, storage_options=options).put("a.bin", [b"1"])
    assert Storage(uri).read("a.bin") == b"1"
