"""A moto S3 server on 127.0.0.1 and a free port: in this process, or as its own process.

In this process (:func:`start_moto`) it serves the session's ``s3_endpoint`` fixture. Run as
a script (``python tests/support/moto_server.py``) it prints its port, serves until its
stdin closes, and stops: tests whose server must check credentials (a process-wide switch
in moto) start it that way, through :func:`checking_moto`, so the session's server keeps
accepting the fake ones. The script imports only moto, so it needs no ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
"""This file, to run as a child process: ``[sys.executable, str(SCRIPT)]``."""


def start_moto() -> tuple[Any, str]:
    """A started ``ThreadedMotoServer`` and its endpoint ``http://127.0.0.1:<port>``."""
    from moto.server import ThreadedMotoServer

    # werkzeug logs every request at INFO; the tests' output should show failures only.
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


@contextmanager
def checking_moto() -> Iterator[tuple[str, str, tuple[str, str], tuple[str, str]]]:
    """A moto server in its own process that verifies signatures and IAM policies.

    Yields ``(endpoint, bucket, allowed, denied)``: one bucket, the access key and secret
    of a user whose policy allows ``s3:*``, and those of a user with no policy at all.
    """
    env = {k: v for k, v in os.environ.items() if k != "INITIAL_NO_AUTH_ACTION_COUNT"}
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        endpoint = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        yield (endpoint, *_users_and_bucket(endpoint))
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)


def _users_and_bucket(endpoint: str) -> tuple[str, tuple[str, str], tuple[str, str]]:
    import boto3

    admin = {
        "endpoint_url": endpoint,
        "region_name": "us-east-1",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
    }
    iam = boto3.client("iam", **admin)
    allowed = _user_with_key(iam, "writer")
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
    }
    iam.put_user_policy(UserName="writer", PolicyName="all-s3", PolicyDocument=json.dumps(policy))
    denied = _user_with_key(iam, "nobody")
    bucket = f"checkflow-auth-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", **admin).create_bucket(Bucket=bucket)
    # From now on every request must be signed by a known key allowed by a policy.
    enable = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=b"0",
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    urllib.request.urlopen(enable, timeout=30).read()
    return bucket, allowed, denied


def _user_with_key(iam: Any, name: str) -> tuple[str, str]:
    iam.create_user(UserName=name)
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


if __name__ == "__main__":
    moto, endpoint = start_moto()
    print(endpoint.rsplit(":", 1)[1], flush=True)
    sys.stdin.read()  # until the test closes our stdin
    moto.stop()
