"""A real browser on a live federation: new rounds appear on an open page without a reload.

Starts ``quorum dashboard`` and ``quorum simulate`` (30 rounds) as subprocesses on
one store, opens the run page in Debian's headless Chromium through Playwright,
and waits for a round committed after the page loaded. Screenshots go to
``test-output/`` for a person to look at.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from dashboard_support import CHROMIUM, CHROMIUM_ARGS, ROOT, XSS_NAME, add_xss_run, free_port, stop
from playwright.sync_api import Page, sync_playwright

from runstore.store import RunStore
from tests.conftest import wait_for

SHOTS = ROOT / "test-output"
# Rounds of the live run: enough that it is still running when each page looks for a new one. With 6, a
# quickstart round of about 3 s finished the run before a loaded machine's Chromium had opened the runs
# page, which then waited for a round that never came. The run is stopped by PID when the test ends.
ROUNDS = 30
ROUNDS_JS = "() => document.querySelectorAll('#rounds-table tbody tr').length"
# Points drawn in the first (server accuracy) trace of the accuracy chart.
POINTS_JS = """() => {
  const trace = document.querySelector('#chart-accuracy .scatterlayer .trace');
  return trace ? trace.querySelectorAll('.points path').length : -1;
}"""

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not on PATH "
                                 "(apt-get install -y chromium); the real-browser test needs it")]


@dataclass(frozen=True)
class Stack:
    base: str
    db_url: str


def _get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    db_url = f"sqlite:///{tmp_path / 'quorum.db'}"
    add_xss_run(RunStore(db_url))
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "QUORUM_DASHBOARD_TOKEN"}, "PYTHONPATH": str(ROOT)}
    with ExitStack() as cleanup:
        dash_log = cleanup.enter_context(open(tmp_path / "dashboard.log", "w"))
        sim_log = cleanup.enter_context(open(tmp_path / "simulate.log", "w"))
        dashboard = subprocess.Popen([sys.executable, "-m", "dashboard", "--db", db_url,
                                      "--host", "127.0.0.1", "--port", str(port)],
                                     cwd=ROOT, env=env, stdout=dash_log, stderr=subprocess.STDOUT)
        cleanup.callback(stop, dashboard)
        simulation = subprocess.Popen([sys.executable, "-m", "quorum", "simulate", "scenarios/quickstart.toml",
                                       "--rounds", str(ROUNDS), "--db", db_url, "--json"],
                                      cwd=ROOT, env=env, stdout=sim_log, stderr=subprocess.STDOUT)
        cleanup.callback(stop, simulation)
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: (r := _get(f"{base}/api/runs")) is not None and r.is_success, 45,
                 "the dashboard to answer", poll_s=0.2)
        yield Stack(base=base, db_url=db_url)


def _running_run(base: str) -> str:
    def probe() -> str | None:
        response = _get(f"{base}/api/runs?status=running")
        runs = response.json() if response is not None and response.is_success else []
        return next((r["id"] for r in runs if r["name"] == "quickstart"), None)

    return str(wait_for(probe, 60, "the simulation to start its run", poll_s=0.2))


def test_run_page_updates_live_and_draws_charts(stack: Stack) -> None:
    SHOTS.mkdir(exist_ok=True)
    run_id = _running_run(stack.base)
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
            _check_live_runs_page(page, stack, run_id)
            _check_live_run_page(page, stack, run_id)
            _check_other_pages(page, stack, run_id)
        finally:
            browser.close()
    assert problems == []


def _check_live_run_page(page: Page, stack: Stack, run_id: str) -> None:
    page.goto(f"{stack.base}/runs/{run_id}")
    page.evaluate("""() => {
      window.__loadedOnce = true;
      window.__arrivals = {};
      new MutationObserver(() => {
        for (const row of document.querySelectorAll('#rounds-table tbody tr'))
          window.__arrivals[row.dataset.round] ??= Date.now() / 1000;
      }).observe(document.querySelector('#rounds-table tbody'), {childList: true});
    }""")
    before = page.evaluate(ROUNDS_JS)
    # Execute: a round committed after the page loaded arrives without a reload
    page.wait_for_function(f"(n) => ({ROUNDS_JS})() > n", arg=before, timeout=60_000)
    # Assert
    assert page.evaluate("() => window.__loadedOnce === true"), "the page reloaded"
    rows = page.evaluate(ROUNDS_JS)
    page.wait_for_function(f"(n) => ({POINTS_JS})() === n", arg=rows, timeout=10_000)
    newest = page.evaluate("() => document.querySelector('#rounds-table tbody tr').dataset.round")
    committed = next(r for r in httpx.get(f"{stack.base}/api/runs/{run_id}/rounds").json() if str(r["round"]) == newest)
    arrived = page.evaluate("(n) => window.__arrivals[n]", newest)
    latency = arrived - (committed["started_at"] + committed["duration_s"])
    print(f"round {newest} reached the open page {latency:.2f} s after its commit")
    # The stream polls the store every 0.5 s (about a second end to end on an idle machine, docs/dashboard.md);
    # 3 s was exceeded (3.2 s) with the e2e tier's other worker training beside Chromium. The page has no
    # other way to learn of a round than the stream, so 10 s still fails a stream that stalls or waits
    # for a later event, and a page that only updates on reload times out above.
    assert latency < 10.0, f"round {newest} reached the page {latency:.2f} s after its commit"
    assert page.locator("#live-indicator").is_visible()
    # the charts are redrawn as each round arrives: wait for the redraw, then count (three loss curves; answered,
    # dropped, rejected, failed)
    page.wait_for_function("() => document.querySelectorAll('#chart-loss .scatterlayer .trace').length === 3 && "
                           "document.querySelectorAll('#chart-clients .barlayer .trace').length === 4",
                           timeout=10_000)
    # accuracy against cumulative bytes: one point per round on each of its two curves
    bytes_points = "() => document.querySelectorAll('#chart-bytes .scatterlayer .trace .points path').length"
    page.wait_for_function(f"(n) => ({bytes_points})() >= 2 * n", arg=rows, timeout=10_000)
    assert page.locator('.cards [data-field="rounds"]').inner_text().startswith(f"{rows} / {ROUNDS}")
    page.screenshot(path=str(SHOTS / "dashboard-run.png"), full_page=True)


def _check_live_runs_page(page: Page, stack: Stack, run_id: str) -> None:
    page.goto(f"{stack.base}/")
    rounds = page.locator(f'tr[data-run-id="{run_id}"] [data-field="rounds"]')
    before = rounds.text_content()
    page.evaluate("() => document.querySelectorAll('[data-count-of]').forEach((c) => { c.textContent = '-'; })")
    page.wait_for_function("([sel, text]) => document.querySelector(sel).textContent !== text",
                           arg=[f'tr[data-run-id="{run_id}"] [data-field="rounds"]', before], timeout=60_000)
    # the status chips' counts are rewritten by the stream's counts event, not by a reload
    page.wait_for_function("() => document.querySelector('[data-count-of=\"\"]').textContent !== '-'",
                           timeout=10_000)
    total = len(httpx.get(f"{stack.base}/api/runs").json())
    assert page.locator('[data-count-of=""]').text_content() == str(total)
    assert page.locator('[data-count-of="running"]').text_content() not in ("-", "0")  # this run is one
    assert page.locator("a.run-name", has_text=XSS_NAME).text_content() == XSS_NAME  # shown as text
    assert page.locator("#live-indicator").is_visible()
    page.screenshot(path=str(SHOTS / "dashboard-runs.png"), full_page=True)


def _check_other_pages(page: Page, stack: Stack, run_id: str) -> None:
    page.goto(f"{stack.base}/runs/{run_id}/rounds/1")
    assert page.locator("#clients-table tbody tr").count() == 10  # 20 clients, half sampled
    page.screenshot(path=str(SHOTS / "dashboard-round.png"), full_page=True)
    page.goto(f"{stack.base}/clients?run={run_id}")
    page.screenshot(path=str(SHOTS / "dashboard-clients.png"), full_page=True)
