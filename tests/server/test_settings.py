"""Coordinator settings: the token from a mounted secret file (Docker, Kubernetes)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from checkflow_server.settings import Settings
from pydantic import ValidationError


def test_the_token_is_read_from_token_file_with_its_newline_stripped(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    assert Settings(db=tmp_path / "c.db", token_file=secret).token == "s3cret"


def test_a_token_given_directly_wins_over_the_file(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("from-file")
    settings = Settings(db=tmp_path / "c.db", token="given", token_file=secret)
    assert settings.token == "given"


def test_the_token_file_is_read_from_the_environment(tmp_path, monkeypatch):
    secret = tmp_path / "token"
    secret.write_text("env-file")
    monkeypatch.setenv("CHECKFLOW_TOKEN_FILE", str(secret))
    monkeypatch.delenv("CHECKFLOW_TOKEN", raising=False)
    assert Settings(db=tmp_path / "c.db").token == "env-file"


@pytest.mark.parametrize("content", [None, "  \n"], ids=["missing", "empty"])
def test_a_missing_or_empty_token_file_is_refused_by_name(tmp_path, content):
    secret = tmp_path / "token"
    if content is not None:
        secret.write_text(content)
    with pytest.raises(ValidationError, match=f"token_file {secret}"):
        Settings(db=tmp_path / "c.db", token_file=secret)


def test_serve_with_a_missing_token_file_exits_2_naming_it(tmp_path):
    missing = tmp_path / "nope"
    cmd = [sys.executable, "-m", "checkflow.cli", "serve", "--token-file", str(missing)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert str(missing) in proc.stderr and "bad setting" in proc.stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_token(tmp_path, host):
    assert Settings(db=tmp_path / "c.db", host=host).token is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.1", "coordinator.internal"])
def test_any_other_host_without_a_token_is_refused_unless_insecure(tmp_path, host):
    with pytest.raises(ValidationError, match=f"host {re.escape(host)} is reachable"):
        Settings(db=tmp_path / "c.db", host=host)
    assert Settings(db=tmp_path / "c.db", host=host, insecure=True).insecure
    assert Settings(db=tmp_path / "c.db", host=host, token="t").token == "t"
