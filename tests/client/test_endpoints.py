"""The coordinator URL list (issue 33): what :func:`endpoints.parse` takes and refuses
(hostile lists: each refusal one line naming the item), the failover's order, and which
redirects may be followed (only to a listed origin, so the token stays with the list)."""

from __future__ import annotations

import pytest

from checkflow.client import endpoints
from checkflow.client.endpoints import BadCoordinatorList, Failover, RedirectRefused
from checkflow.client.env import resolve
from checkflow.config import CheckpointConfig


def test_one_url_and_a_list_with_spaces_around_commas_parse_to_base_urls():
    assert endpoints.parse("http://a:8470/").urls == ("http://a:8470",)
    got = endpoints.parse(" http://a:8470 , https://b/prefix/ ,http://[::1]:9")
    assert got.urls == ("http://a:8470", "https://b/prefix", "http://[::1]:9")
    assert str(got) == "http://a:8470,https://b/prefix,http://[::1]:9"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "no coordinator URL"),
        (" , ", "no coordinator URL"),
        ("http://a:1,,http://b:2", "coordinator URL 2 is empty"),
        ("http://a:1,", "coordinator URL 2 is empty"),
        (",http://a:1", "coordinator URL 1 is empty"),
        ("http://a :1", "whitespace or control characters"),
        ("http://a:1\n,http://b:2", None),  # stripped around the comma: fine
        ("http://a\x1b[31m:1", "whitespace or control characters"),
        ("http://a\u200b:1", "whitespace or control characters"),
        ("ftp://a:1", "not http:// or https://"),
        ("file:///etc/passwd", "not http:// or https://"),
        ("a:8470", "not http:// or https://"),
        ("127.0.0.1:8470", "not http:// or https://"),
        ("javascript:alert(1)", "not http:// or https://"),
        ("http://", "names no host"),
        ("http://:8470", "names no host"),
        ("http://a:99999", "bad port"),
        ("http://a:port", "bad port"),
        ("http://user:pw@a:1", "user info"),
        ("http://a:1/?x=1", "query or fragment"),
        ("http://a:1#f", "query or fragment"),
        ("http://a:1?", "query or fragment"),
        ("http://a:1,http://A:1/", "listed twice"),
        ("http://a,http://a:80", "listed twice"),
        ("https://a,https://a:443", "listed twice"),
        ("http://" + "a" * 3000, "over 2048 characters"),
        (",".join(f"http://h{i}:1" for i in range(33)), "at most 32"),
    ],
)
def test_a_bad_list_is_refused_in_one_line_naming_what_is_wrong(text: str, says: str | None):
    if says is None:
        assert len(endpoints.parse(text).urls) == 2
        return
    with pytest.raises(BadCoordinatorList, match=says) as e:
        endpoints.parse(text)
    assert "\n" not in str(e.value) and "\x1b" not in str(e.value)  # repr'd: escaped
    assert isinstance(e.value, ValueError)


def test_every_setting_that_takes_a_url_takes_and_checks_a_list():
    urls = "http://a:8470,http://b:8470"
    assert resolve(None, "j", None, {"CHECKFLOW_COORDINATOR": urls}).url == urls
    assert CheckpointConfig(coordinator=urls, job="j").coordinator == urls
    with pytest.raises(ValueError, match="coordinator URL 2 is empty"):
        resolve(None, "j", None, {"CHECKFLOW_COORDINATOR": "http://a:1,,http://b:1"})
    with pytest.raises(ValueError, match="not http:// or https://"):
        CheckpointConfig(coordinator="a:8470", job="j")


def test_the_failover_sticks_to_the_one_that_answered_and_leaves_a_failed_one():
    f = Failover(endpoints.parse("http://a:1,http://b:2,http://c:3"))
    assert f.order() == ["http://a:1", "http://b:2", "http://c:3"]
    f.failed("http://a:1")
    assert f.order() == ["http://b:2", "http://c:3", "http://a:1"]
    f.failed("http://a:1")  # not the current one: no change
    assert f.current == "http://b:2"
    f.answered("http://C:3/v1/jobs/x?y=1")  # a redirect's target, any path on its origin
    assert f.current == "http://c:3"
    f.answered("http://elsewhere:1/")  # not listed: ignored
    assert f.current == "http://c:3"


def test_a_redirect_is_followed_only_to_a_listed_origin():
    listed = endpoints.parse("http://a:1,http://b:2/prefix")
    at = "http://a:1/v1/jobs/j"
    assert endpoints.redirect_target(listed, at, "http://b:2/v1/jobs/j") == "http://b:2/v1/jobs/j"
    assert endpoints.redirect_target(listed, at, "/v1/jobs/k?x=1") == "http://a:1/v1/jobs/k?x=1"
    for far in (
        "http://evil:1/v1/jobs/j",
        "http://b:3/v1/jobs/j",  # another port of a listed host
        "https://a:1/v1/jobs/j",  # another scheme
        "//evil:2/x",
        "http://a:1@evil:2/x",
        "javascript:alert(1)",
    ):
        with pytest.raises(RedirectRefused, match="not one of the coordinator URLs given"):
            endpoints.redirect_target(listed, at, far)
