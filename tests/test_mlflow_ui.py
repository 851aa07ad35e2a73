"""The MLflow UI, as a person sees it: the run-comparison page in headless Chromium shows
the dp/tp/pp layout of two real `kedro run`s side by side.

The runs and the tracking server are the team-environment stack of tests/servers.py
(shared, so the two training runs are paid once). The page is read from the rendered DOM,
not from the REST API. Set MESHTRAIN_UI_SCREENSHOT=docs/images/mlflow_compare.png to
refresh the picture in docs/tracking.md.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import servers


@pytest.fixture(scope="session")
def chromium() -> str:
    """Checked before `team`, so a machine without Chromium skips before starting servers."""
    servers.require(Path(servers.CHROMIUM).exists(), "chromium")
    return servers.CHROMIUM


@pytest.fixture(scope="session")
def team(chromium, tmp_path_factory) -> Iterator[servers.TeamTracking]:
    try:
        yield servers.team_tracking(tmp_path_factory)
    finally:
        servers.stop_team_tracking()


# Each row of the compare page's tables: the header cell, then one cell per run.
READ_ROWS = """() => Object.fromEntries(
    Array.from(document.querySelectorAll('tr'))
        .filter(tr => tr.querySelector('th'))
        .map(tr => [tr.querySelector('th').innerText.trim(),
                    Array.from(tr.querySelectorAll('td')).map(td => td.innerText.trim())]))"""


@pytest.mark.slow
def test_compare_page_shows_the_layouts_of_both_runs(chromium, team, tmp_path: Path):
    assert team.dp2.returncode == 0, servers.output(team.dp2)
    assert team.tp2.returncode == 0, servers.output(team.tp2)
    client = team.client()
    experiment = client.get_experiment_by_name("meshtrain")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    layouts = {run.info.run_name: run.info.run_id for run in runs}
    ids = [layouts[servers.DP2_LAYOUT], layouts[servers.TP2_LAYOUT]]
    query = urllib.parse.urlencode(
        {"runs": json.dumps(ids), "experiments": json.dumps([experiment.experiment_id])}
    )
    url = f"{team.server.uri}/#/compare-runs?{query}"

    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # Debian's Chromium, never a downloaded one; Playwright gives it a fresh profile.
        browser = playwright.chromium.launch(executable_path=chromium, args=servers.CHROMIUM_FLAGS)
        try:
            # The server asks for basic auth (tests/servers.py); the browser answers as admin.
            admin = team.server.admin
            page = browser.new_page(
                viewport={"width": 1280, "height": 1200},
                http_credentials={"username": admin.username, "password": admin.password},
            )
            page.goto(url)
            page.locator("th", has_text="parallel.tensor_parallel_size").first.wait_for(
                timeout=90_000
            )
            rows = page.evaluate(READ_ROWS)
            # The metrics table is a virtual grid of links to each metric's chart.
            metric_links = page.locator("a[title='Plot chart']").all_inner_texts()
            # Then what a person does to see what differs, for the picture in the docs.
            page.get_by_text("Visualizations", exact=True).click()
            page.get_by_role("switch", name="Parameters - Show diff only").click()
            assistant = page.get_by_role("button", name="Close")
            if assistant.count():
                assistant.first.click()
            # Equal values are hidden now; the differing layout rows end the table.
            page.locator("th", has_text="parallel.pipeline_parallel_size").first.wait_for(
                state="detached", timeout=10_000
            )
            last_diff = page.locator("tr", has=page.locator("th", has_text="parallel.zero_1"))
            last_diff.first.evaluate("row => row.scrollIntoView({block: 'nearest'})")
            screenshot = tmp_path / "mlflow_compare.png"
            page.screenshot(path=str(screenshot))
        finally:
            browser.close()

    assert rows["Run Name:"] == [servers.DP2_LAYOUT, servers.TP2_LAYOUT]
    assert rows["parallel.data_parallel_size"] == ["2", "1"]
    assert rows["parallel.tensor_parallel_size"] == ["1", "2"]
    assert rows["parallel.pipeline_parallel_size"] == ["1", "1"]
    assert rows["parallel.zero_1"] == ["True", "False"]
    assert rows["parallel.sequence_parallel"] == ["False", "True"]
    assert "loss" in [text.strip() for text in metric_links]
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    target = os.environ.get("MESHTRAIN_UI_SCREENSHOT")
    if target:
        shutil.copyfile(screenshot, target)
