"""The dashboard in a real headless Chromium against a real coordinator: signing in, what
it shows of a job that the test drives through the API, and that it updates by itself."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from playwright.sync_api import BrowserContext, Page, expect

from checkflow.protocol import JobCreate, StopReason
from tests.dashboard.api_ranks import ApiRanks
from tests.support.coordinator import TOKEN, ServerProcess

MiB = 1 << 20
SESSION = "checkflow_session"


def _job(server: ServerProcess, name: str, world: int) -> ApiRanks:
    """A job created through the API; its ranks stay quiet for minutes without a failure."""
    server.create_job(
        JobCreate(name=name, world_size=world, heartbeat_timeout_s=300, hang_timeout_s=600)
    )
    return ApiRanks(server.http(), name, world)


def _record_urls(browser: BrowserContext) -> list[str]:
    urls: list[str] = []
    browser.on("request", lambda request: urls.append(request.url))
    return urls


def _sign_in(page: Page, server: ServerProcess, token: str) -> int:
    """Open ``/``, check it asks for the token, submit ``token``; the /login status."""
    first = page.goto(server.url + "/")
    assert first is not None and first.status == 401
    expect(page.locator("form#login")).to_be_visible()
    page.fill("#token", token)
    with page.expect_response(lambda r: r.url == server.url + "/login") as login:
        page.click("form#login button[type=submit]")
    return login.value.status


def test_form_sign_in_shows_the_job_made_through_the_api_and_a_commit_appears_live(
    server: ServerProcess, browser: BrowserContext
) -> None:
    ranks = _job(server, "run-1", world=2)
    urls = _record_urls(browser)
    page = browser.pages[0]
    assert _sign_in(page, server, TOKEN) == 303

    row = page.locator('#jobs-table tr[data-job="run-1"]')
    expect(row).to_contain_text("run-1")
    row.get_by_role("link", name="run-1").click()  # other tests' jobs share the coordinator
    expect(page.locator("#job-name")).to_have_text("run-1")
    assert page.url == server.url + "/#job=run-1"
    (cookie,) = [c for c in browser.cookies() if c["name"] == SESSION]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    assert TOKEN not in cookie["value"]
    loads = len([u for u in urls if u == server.url + "/"])

    ranks.register()
    ranks.heartbeat(step=10)
    expect(page.locator("#ranks-table tbody tr")).to_have_count(2)
    expect(page.locator('#ranks-table tr[data-rank="1"]')).to_contain_text("10")
    ranks.persist(10, 3 * MiB, range(1))
    checkpoint = page.locator('#checkpoints-table tr[data-step="10"]')
    expect(checkpoint).to_have_attribute("data-status", "in_progress")
    expect(checkpoint).to_contain_text("1/2")
    expect(checkpoint).to_contain_text("full")
    ranks.checkpoint(10, 3 * MiB, range(1, 2), kind="delta")  # one delta part: a delta
    expect(checkpoint).to_have_attribute("data-status", "committed")
    expect(checkpoint).to_contain_text("6.0 MiB")
    expect(checkpoint).to_contain_text("delta")
    expect(row).to_contain_text("10")  # the job's restore step

    # It updated by polling the API, not by reloading the page.
    assert len([u for u in urls if u == server.url + "/"]) == loads
    assert any("/v1/jobs/run-1/checkpoints" in u for u in urls)
    assert [u for u in urls if TOKEN in u] == []
    assert [u for u in urls if not u.startswith(server.url + "/")] == [], "only the coordinator"


def test_wrong_token_gets_the_form_again_with_401_and_no_data(
    server: ServerProcess, browser: BrowserContext
) -> None:
    _job(server, "secret-job", world=1)
    urls = _record_urls(browser)
    page = browser.pages[0]
    assert _sign_in(page, server, "not-the-token") == 401

    expect(page.locator(".error")).to_contain_text("Wrong token")
    expect(page.locator("form#login")).to_be_visible()
    assert [c for c in browser.cookies() if c["name"] == SESSION] == []
    assert page.evaluate("fetch('/v1/jobs').then(r => r.status)") == 401
    assert page.goto(server.url + "/").status == 401  # type: ignore[union-attr]
    assert "secret-job" not in page.content()
    assert [u for u in urls if "not-the-token" in u or TOKEN in u] == []


def test_token_in_an_authorization_header_opens_the_page_without_the_form(
    server: ServerProcess, browser: BrowserContext
) -> None:
    _job(server, "behind-a-proxy", world=1)
    browser.set_extra_http_headers({"Authorization": f"Bearer {TOKEN}"})
    page = browser.pages[0]
    response = page.goto(server.url + "/")
    assert response is not None and response.status == 200
    expect(page.locator('#jobs-table tr[data-job="behind-a-proxy"]')).to_be_visible()
    assert [c for c in browser.cookies() if c["name"] == SESSION] == []


def test_jobs_that_ended_show_how_they_ended_not_no_live_ranks(
    server: ServerProcess, browser: BrowserContext
) -> None:
    done = _job(server, "ended-well", world=2)
    done.register()
    done.heartbeat(30)
    done.finish(30)
    stopped = _job(server, "ctrl-c", world=1)
    stopped.register()
    stopped.stop(StopReason.INTERRUPTED)
    browser.set_extra_http_headers({"Authorization": f"Bearer {TOKEN}"})
    page = browser.pages[0]
    page.goto(server.url + "/#job=ended-well")

    row = page.locator('#jobs-table tr[data-job="ended-well"]')
    expect(row.locator(".badge")).to_have_text("finished")
    expect(page.locator('#jobs-table tr[data-job="ctrl-c"] .badge')).to_have_text("stopped")
    expect(page.locator("#job-state")).to_have_text("finished")
    expect(page.locator("#jobs-table")).not_to_contain_text("no live ranks")


def _train_fail_and_recover(ranks: ApiRanks) -> tuple[int, int]:
    """Checkpoints under changing snapshot costs (the interval follows), rank 2 crashes
    with a checkpoint half persisted, the group comes back and trains again, then more
    checkpoints, the last one in progress. Returns (abandoned step, restore step)."""
    ranks.register()
    step = 0
    for i, stall in enumerate([0.10, 0.10, 0.10, 0.30, 0.30, 0.30, 0.05, 0.05]):
        step += 400
        ranks.heartbeat(step, iteration_s=0.5, stall_s=stall)
        time.sleep(0.25)  # a retune runs (every 0.1 s)
        full = i % 4 == 0  # a full checkpoint now and then, deltas between
        ranks.checkpoint(step, (40 if full else 6) * MiB, kind="full" if full else "delta")
    restore = step
    step += 400
    ranks.heartbeat(step, iteration_s=0.5, stall_s=0.05)
    ranks.persist(step, 6 * MiB, range(2))
    ranks.crash(2, seconds_ago=0.35)
    time.sleep(0.4)
    ranks.register()
    # Past the abandoned step without taking it again: it stays abandoned on the timeline.
    for step in range(restore + 300, restore + 1500, 400):
        ranks.heartbeat(step, iteration_s=0.5, stall_s=0.05)
        time.sleep(0.25)
        ranks.checkpoint(step, (40 if step == restore + 700 else 6) * MiB)
    ranks.heartbeat(restore + 1600, iteration_s=0.5, stall_s=0.05)
    ranks.persist(restore + 1600, 6 * MiB, range(3))
    return restore + 400, restore


def test_job_page_shows_timeline_ranks_recovery_and_plots(
    server: ServerProcess, browser: BrowserContext, tmp_path: Path
) -> None:
    other = _job(server, "bert-finetune", world=2)
    other.register()
    other.heartbeat(120, iteration_s=0.2, stall_s=0.01)
    ranks = _job(server, "llama-pretrain", world=4)
    abandoned, restore = _train_fail_and_recover(ranks)
    browser.set_extra_http_headers({"Authorization": f"Bearer {TOKEN}"})
    page = browser.pages[0]
    page.goto(server.url + "/#job=llama-pretrain")

    expect(page.locator("#job-name")).to_have_text("llama-pretrain")
    expect(page.locator('#jobs-table tr[data-job="bert-finetune"]')).to_contain_text("training")
    # The interval says where it comes from: tuned by the coordinator (0.01 s per 0.2 s step
    # under a 3.5 % budget: 2 steps), not the warm-up's 10 nor the ranks' fixed every.
    expect(page.locator('#jobs-table tr[data-job="bert-finetune"]')).to_contain_text("2 tuned")
    expect(page.locator('#jobs-table tr[data-job="llama-pretrain"]')).to_contain_text(" tuned")
    recovery = page.locator("#recoveries-table tr[data-generation]").first
    expect(recovery).to_contain_text("crash")
    expect(recovery).to_contain_text("0.35 s")  # detection latency: what the launcher saw
    expect(recovery).to_contain_text(str(restore))
    expect(recovery).not_to_contain_text("recovering")
    expect(page.locator('#failures-table tr[data-rank="2"]')).to_contain_text("crash")
    lost = page.locator(f'#checkpoints-table tr[data-step="{abandoned}"]')
    expect(lost).to_have_attribute("data-status", "abandoned")
    expect(page.locator("#checkpoints-table tr[data-status=in_progress]")).to_have_count(1)
    expect(page.locator("#timeline rect[data-status=committed]")).to_have_count(11)
    expect(page.locator("#ranks-table tbody tr")).to_have_count(4)
    expect(page.locator('#ranks-table tr[data-rank="3"]')).to_contain_text(str(restore + 1600))
    expect(page.locator("#interval-plot circle").nth(2)).to_be_attached()  # changes plotted
    expect(page.locator("#overhead-plot circle").first).to_be_attached()
    expect(page.locator("#error")).to_be_hidden()
    assert re.search(r"updated \d", page.locator("#updated").inner_text())

    out = Path(os.environ.get("CHECKFLOW_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
    page.screenshot(path=str(out), full_page=True)
    assert out.stat().st_size > 10_000
