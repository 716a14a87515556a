"""Every setting that has a ``CHECKFLOW_*`` variable resolves in one order: the argument
when given, else the variable, else the default (README, "Settings"). One table of cases,
run against each place that resolves one, so a new variable joins the table or is missed
by review, not silently resolved another way."""

from __future__ import annotations

import argparse

import pytest

from checkflow.cli import coordinator as cli_coordinator
from checkflow.client import env
from checkflow.client.transport import unauthorized_hint
from checkflow.config import CheckpointConfig, with_launcher_settings
from checkflow.launch.launcher import coordinator_settings
from checkflow.memory.area import ram_dir_setting

BOTH = {"CHECKFLOW_COORDINATOR": "http://env:1", "CHECKFLOW_JOB": "env-job"}


def launcher_setting(field: str, given: str | None, environ: dict[str, str]) -> str | None:
    args = argparse.Namespace(coordinator="http://arg:1", job="arg-job", token=None)
    setattr(args, {"url": "coordinator"}.get(field, field), given)
    return getattr(coordinator_settings(args, {**BOTH, **environ}), field)


CHECKPOINTER = [
    ("CHECKFLOW_COORDINATOR", "coordinator"),
    ("CHECKFLOW_JOB", "job"),
    ("CHECKFLOW_TOKEN", "token"),
]
ENVIRONMENT = {**BOTH, "CHECKFLOW_TOKEN": "env-token"}


@pytest.mark.parametrize(("variable", "field"), CHECKPOINTER)
def test_a_checkpointer_argument_beats_its_variable_which_beats_the_default(variable, field):
    # coordinator= alone is refused by the config itself (it needs job= beside it)
    partner = {"job": "arg-job"} if field == "coordinator" else {}
    value = "http://from-arg:1" if field == "coordinator" else "from-arg"  # a URL is checked
    config = CheckpointConfig(**{**partner, field: value})
    given = with_launcher_settings(config, ENVIRONMENT)
    assert getattr(given, field) == value
    from_env = with_launcher_settings(CheckpointConfig(), ENVIRONMENT)
    assert getattr(from_env, field) == ENVIRONMENT[variable]
    assert getattr(with_launcher_settings(CheckpointConfig(), {}), field) is None


def test_the_token_of_the_environment_is_sent_when_the_script_names_its_coordinator():
    """The README's journey: ``CHECKFLOW_TOKEN=T python train.py --coordinator URL --job J``."""
    config = CheckpointConfig(coordinator="http://arg:1", job="arg-job")
    resolved = with_launcher_settings(config, {"CHECKFLOW_TOKEN": "T"})
    assert (resolved.coordinator, resolved.job, resolved.token) == ("http://arg:1", "arg-job", "T")


def test_each_coordinator_setting_resolves_on_its_own():
    config = CheckpointConfig(coordinator="http://arg:1", job="arg-job", token="arg-token")
    environ = {**BOTH, "CHECKFLOW_TOKEN": "env-token"}
    resolved = with_launcher_settings(config, environ)
    assert (resolved.coordinator, resolved.job, resolved.token) == (
        "http://arg:1",
        "arg-job",
        "arg-token",
    )
    only_job = with_launcher_settings(CheckpointConfig(job="arg-job"), environ)
    assert (only_job.coordinator, only_job.job, only_job.token) == (
        "http://env:1",
        "arg-job",
        "env-token",
    )


@pytest.mark.parametrize("field", ["url", "job", "token"])
def test_checkflow_run_resolves_the_same_way(field):
    variable = {"url": env.COORDINATOR, "job": env.JOB, "token": env.TOKEN}[field]
    arg, var = ("http://from-arg:1", "http://from-env:1") if field == "url" else ("a", "e")
    assert launcher_setting(field, arg, {variable: var}) == arg
    assert launcher_setting(field, None, {variable: var}) == var
    if field == "token":  # an empty variable is not a token
        assert launcher_setting(field, None, {variable: ""}) is None
    else:  # and not a URL or a job: the pair is incomplete, said with both ways to set it
        with pytest.raises(ValueError, match=f"is set but --.* is not.*{variable}"):
            launcher_setting(field, None, {variable: ""})


def test_the_ram_tier_folder_resolves_the_same_way():
    environ = {"CHECKFLOW_RAM_DIR": "/dev/shm/env"}
    assert ram_dir_setting("/dev/shm/arg", environ) == "/dev/shm/arg"
    assert ram_dir_setting(None, environ) == "/dev/shm/env"
    assert ram_dir_setting(None, {"CHECKFLOW_RAM_DIR": ""}) is None
    assert ram_dir_setting(None, {}) is None


def test_the_cli_s_url_and_token_resolve_the_same_way(monkeypatch):
    monkeypatch.setenv("CHECKFLOW_URL", "http://env:1")
    assert cli_coordinator.coordinator_url("http://arg:1") == "http://arg:1"
    assert cli_coordinator.coordinator_url(None) == "http://env:1"
    monkeypatch.delenv("CHECKFLOW_URL")
    assert cli_coordinator.coordinator_url(None) == cli_coordinator.DEFAULT_URL

    monkeypatch.setenv("CHECKFLOW_TOKEN", "env-token")
    with cli_coordinator.connect("http://127.0.0.1:9", None) as http:
        assert http.headers["Authorization"] == "Bearer env-token"
    monkeypatch.delenv("CHECKFLOW_TOKEN")
    with cli_coordinator.connect("http://127.0.0.1:9", None) as http:
        assert "Authorization" not in http.headers


def test_a_token_file_beats_the_variable_in_the_cli(tmp_path, monkeypatch):
    monkeypatch.setenv("CHECKFLOW_TOKEN", "env-token")
    path = tmp_path / "token"
    path.write_text("file-token\n")
    with cli_coordinator.connect("http://127.0.0.1:9", None, str(path)) as http:
        assert http.headers["Authorization"] == "Bearer file-token"


@pytest.mark.parametrize(
    ("given", "value"),
    [("a", "a"), (None, "e"), ("", "e")],
)
def test_one_function_decides_and_an_empty_value_counts_as_not_given(given, value):
    assert env.setting(given, "CHECKFLOW_X", {"CHECKFLOW_X": "e"}) == value
    assert env.setting(None, "CHECKFLOW_X", {"CHECKFLOW_X": ""}, "d") == "d"
    assert env.setting(None, "CHECKFLOW_X", {}) is None


def test_a_url_without_a_job_anywhere_is_refused_naming_both_ways():
    with pytest.raises(ValueError, match=r"--coordinator is set but --job is not.*CHECKFLOW_JOB"):
        env.resolve("http://arg:1", None, None, {})


def test_a_401_hint_depends_on_whether_a_token_was_sent():
    assert unauthorized_hint(sent=True).startswith("the token sent is not this coordinator's")
    assert "pass --token" not in unauthorized_hint(sent=True)
    assert unauthorized_hint(sent=False).startswith("no token was sent")
    assert "CHECKFLOW_TOKEN" in unauthorized_hint(sent=False)
