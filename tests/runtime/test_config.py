"""CheckpointConfig: every bad option is refused up front with the argument's name."""

from __future__ import annotations

import pytest

from checkflow import Checkpointer, list_checkpoints
from checkflow.config import CheckpointConfig
from tests.runtime._models import small_state, train_step


def test_defaults_are_valid_and_tune_the_interval():
    config = CheckpointConfig()
    assert config.every == "auto" and config.auto
    assert not CheckpointConfig(every=5).auto


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every": 0}, r"every must be a positive int or 'auto', got 0"),
        ({"every": "often"}, r"every must be .*'often'"),
        ({"every": True}, r"every must be .*True"),
        ({"every": 2.5}, r"every must be .*2\.5"),
        ({"max_overhead": 0}, r"max_overhead must be in \(0, 1\], got 0"),
        ({"max_overhead": 1.5}, r"max_overhead must be in \(0, 1\], got 1\.5"),
        ({"max_overhead": "low"}, r"max_overhead must be .*'low'"),
        ({"keep": -1}, r"keep must be >= 0 .*got -1"),
        ({"keep": 1.0}, r"keep must be >= 0 .*got 1\.0"),
        ({"full_every": 0}, r"full_every must be >= 1, got 0"),
        ({"when_busy": "drop"}, r"when_busy must be one of \('wait', 'skip'\), got 'drop'"),
        ({"coordinator": "http://127.0.0.1:1"}, r"coordinator= needs job="),
        ({"storage_options": ["anon"]}, r"storage_options must be a dict"),
        ({"codec": "q3"}, r"unknown codec 'q3'.*valid codecs: .*exact"),
        ({"codec": 3}, r"codec must be a codec name"),
        ({"hang_timeout": 0}, r"hang_timeout must be seconds in \[0\.1, 1e9\] or None, got 0"),
        ({"hang_timeout": "1m"}, r"hang_timeout must be .*'1m'"),
        ({"hang_timeout": True}, r"hang_timeout must be .*True"),
    ],
)
def test_a_bad_option_raises_a_value_error_naming_it(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CheckpointConfig(**kwargs)


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        CheckpointConfig(5)  # type: ignore[misc]


def test_checkpointer_takes_a_config_object_and_applies_it(tmp_path):
    state = small_state()
    config = CheckpointConfig(every=2, keep=0, rng=False)
    with Checkpointer(str(tmp_path), state, config=config) as ck:
        assert ck.config is config
        for _ in range(5):
            train_step(state)
            ck.step()
    assert [c.step for c in list_checkpoints(str(tmp_path))] == [2, 4]


def test_checkpointer_keyword_options_become_its_config(tmp_path):
    ck = Checkpointer(str(tmp_path), small_state(), every=7, when_busy="skip")
    assert ck.config == CheckpointConfig(every=7, when_busy="skip")
    assert ck.stats.interval == 7


def test_config_and_keyword_options_together_are_refused(tmp_path):
    with pytest.raises(TypeError, match="either as config= or as keyword arguments"):
        Checkpointer(str(tmp_path), small_state(), every=3, config=CheckpointConfig(every=2))


def test_a_launcher_s_coordinator_settings_fill_in_what_the_script_did_not_give():
    from checkflow.config import with_launcher_settings

    env = {
        "CHECKFLOW_COORDINATOR": "http://127.0.0.1:8470",
        "CHECKFLOW_JOB": "j",
        "CHECKFLOW_TOKEN": "t",
    }
    cfg = with_launcher_settings(CheckpointConfig(every=5), env)
    expected = ("http://127.0.0.1:8470", "j", "t", 5)
    assert (cfg.coordinator, cfg.job, cfg.token, cfg.every) == expected


def test_the_script_s_own_coordinator_wins_over_the_launcher_s():
    from checkflow.config import with_launcher_settings

    env = {"CHECKFLOW_COORDINATOR": "http://a", "CHECKFLOW_JOB": "a"}
    own = CheckpointConfig(coordinator="http://b", job="b")
    assert with_launcher_settings(own, env) == own
    assert with_launcher_settings(CheckpointConfig(), {}) == CheckpointConfig()


def test_a_launcher_url_without_a_job_is_refused_with_what_to_set():
    from checkflow.config import with_launcher_settings

    with pytest.raises(ValueError, match="CHECKFLOW_JOB"):
        with_launcher_settings(CheckpointConfig(), {"CHECKFLOW_COORDINATOR": "http://a"})
