"""Command-line values shared by the commands (in-process, no torch)."""

from __future__ import annotations

import pytest

from checkflow.cli.arguments import parse_storage_options
from checkflow.cli.output import EXIT_USAGE, CliError


def test_storage_options_nest_dotted_keys_and_parse_scalars() -> None:
    got = parse_storage_options(
        [
            "client_kwargs.endpoint_url=http://127.0.0.1:9000",
            "client_kwargs.region_name=us-east-1",
            "anon=false",
            "config_kwargs.retries.total_max_attempts=2",
            'key="0123"',
        ]
    )
    assert got == {
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "region_name": "us-east-1"},
        "anon": False,
        "config_kwargs": {"retries": {"total_max_attempts": 2}},
        "key": "0123",
    }


@pytest.mark.parametrize(
    ("items", "says"),
    [
        (["a.=1"], "is not KEY=VALUE"),
        (["a=1", "a.b=2"], "conflicts with a=1"),
        (["a.b=1", "a=2"], "conflicts with the nested a.* options"),
        (['k={"x"'], "is not valid JSON"),
    ],
)
def test_storage_options_that_conflict_or_do_not_parse_are_usage_errors(
    items: list[str], says: str
) -> None:
    with pytest.raises(CliError) as err:
        parse_storage_options(items)
    assert says in str(err.value) and err.value.code == EXIT_USAGE
