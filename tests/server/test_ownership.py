"""The rules of job leases (``domain/ownership.py``), and the settings a replica refuses."""

from __future__ import annotations

import pytest
from checkflow_server.domain import ownership
from checkflow_server.domain.ownership import Lease, Route
from checkflow_server.settings import Settings

from checkflow.cli import main

ME, OTHER = "http://10.0.0.1:8470", "http://10.0.0.2:8470"


def test_a_live_lease_of_another_replica_redirects_and_any_other_is_taken() -> None:
    live = Lease(1, OTHER, expires=100.0, epoch=3)
    assert ownership.route(live, ME, now=99.9) == Route.REDIRECT
    assert ownership.route(live, ME, now=100.0) == Route.TAKE  # expired
    assert ownership.route(None, ME, now=0.0) == Route.TAKE  # a job from before leases
    mine = Lease(1, ME, expires=100.0, epoch=3)  # this replica's, before its restart
    assert ownership.route(mine, ME, now=50.0) == Route.TAKE


def test_the_fence_holds_only_for_the_same_owner_and_epoch() -> None:
    lease = Lease(1, ME, expires=10.0, epoch=4)
    assert ownership.holds(lease, ME, 4)
    assert ownership.holds(lease, ME, 4)  # expired but nobody took it: still ours
    assert not ownership.holds(lease, ME, 3)  # taken and given back meanwhile
    assert not ownership.holds(Lease(1, OTHER, 10.0, 4), ME, 4)
    assert not ownership.holds(None, ME, 4) and not ownership.holds(lease, ME, None)
    assert ownership.next_epoch(lease) == 5 and ownership.next_epoch(None) == 1


def test_lost_jobs_are_those_not_renewed_under_their_epoch() -> None:
    assert ownership.lost({1: 2, 2: 5, 3: 1}, {1: 2, 2: 6}) == {2, 3}
    assert ownership.lost({}, {7: 1}) == set()


def test_a_redirect_keeps_path_and_query_and_never_adds_a_host() -> None:
    path = "/v1/jobs/a b/ranks/0/heartbeat"
    assert (
        ownership.location(OTHER + "/", path, "x=1")
        == f"{OTHER}/v1/jobs/a%20b/ranks/0/heartbeat?x=1"
    )
    # A path that looks like another authority stays a path on the owner.
    assert ownership.location(OTHER, "//evil.example/x", "").startswith(OTHER + "//")


def test_failover_fits_the_issue_bound() -> None:
    assert ownership.RENEW_S * 3 <= ownership.TTL_S
    assert ownership.TTL_S + ownership.TAKEOVER_S < 15


@pytest.mark.parametrize(
    "url",
    ["ftp://a:1", "http://", "http://a:1/path", "http://u@a:1", "http://a:99999", "a:1",
     "http://a:1?x", "http://a b:1", "http://a:1#f", "http://a:x"],
)  # fmt: skip
def test_a_bad_advertise_url_is_refused_with_exit_2(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="advertise_url"):
        Settings(advertise_url=url)
    assert main(["serve", "--db", "postgresql://u@127.0.0.1:1/d", "--advertise-url", url]) == 2
    err = capsys.readouterr().err
    assert "advertise_url" in err and len(err.strip().splitlines()) == 1


def test_the_default_advertised_url_is_host_and_port() -> None:
    s = Settings(db="postgresql://u@127.0.0.1:5432/d", port=9000)
    assert s.replicated and s.advertised() == "http://127.0.0.1:9000"
    assert Settings(advertise_url="https://c.example:443/").advertised() == "https://c.example:443"
    assert not Settings(db="/tmp/x.db").replicated
    with pytest.raises(ValueError, match="advertise-url"):
        Settings(db="postgresql://u@127.0.0.1:5432/d", port=0)


def test_an_unreachable_postgresql_fails_the_start_in_one_line_with_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tests.support.net import free_port

    url = f"postgresql://nobody:secret@127.0.0.1:{free_port()}/nothing"
    assert main(["serve", "--db", url, "--port", str(free_port())]) == 1
    err = capsys.readouterr().err.strip()
    assert "cannot open postgresql://nobody:***@127.0.0.1" in err and "secret" not in err
    assert len(err.splitlines()) == 1


def test_a_postgresql_url_without_a_database_fails_the_start(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--db", "postgresql://u@127.0.0.1:5432"]) == 1
    assert "needs a database name" in capsys.readouterr().err
