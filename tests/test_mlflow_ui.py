"""The MLflow UI, as a person sees it, in headless Chromium: the run-comparison page shows
the dp/tp/pp layout of two real `kedro run`s side by side, and the dp=2 run's page shows
its two datasets, its logged and registered model and its samples table.

The runs and the tracking server are the team-environment stack of tests/servers.py
(shared, so the runs are paid once). The page is read from the rendered DOM, not from the
REST API. Set MESHTRAIN_UI_SCREENSHOT=docs/images/mlflow_compare.png to refresh the
pictures in docs/tracking.md (mlflow_run.png, mlflow_run_datasets.png and
mlflow_samples.png go beside it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import urllib.parse
from pathlib import Path

import pytest

from tests import servers


@pytest.fixture(scope="session")
def chromium() -> str:
    """Checked before `team`, so a machine without Chromium skips before starting servers."""
    servers.require(Path(servers.CHROMIUM).exists(), "chromium")
    return servers.CHROMIUM


# Each row of the compare page's tables: the header cell, then one cell per run.
READ_ROWS = """() => Object.fromEntries(
    Array.from(document.querySelectorAll('tr'))
        .filter(tr => tr.querySelector('th'))
        .map(tr => [tr.querySelector('th').innerText.trim(),
                    Array.from(tr.querySelectorAll('td')).map(td => td.innerText.trim())]))"""


@pytest.mark.slow
@pytest.mark.long
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
            last_diff = page.locator(
                "tr", has=page.locator("th", has_text="parallel.tensor_parallel_size")
            )
            last_diff.first.evaluate("row => row.scrollIntoView({block: 'nearest'})")
            screenshot = tmp_path / "mlflow_compare.png"
            page.screenshot(path=str(screenshot))
        finally:
            browser.close()

    assert rows["Run Name:"] == [servers.DP2_LAYOUT, servers.TP2_LAYOUT]
    assert rows["parallel.data_parallel_size"] == ["2", "1"]
    assert rows["parallel.tensor_parallel_size"] == ["1", "2"]
    assert rows["parallel.pipeline_parallel_size"] == ["1", "1"]
    assert rows["parallel.zero_1"] == ["False", "False"]
    assert rows["parallel.sequence_parallel"] == ["False", "True"]
    assert "loss" in [text.strip() for text in metric_links]
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    target = os.environ.get("MESHTRAIN_UI_SCREENSHOT")
    if target:
        shutil.copyfile(screenshot, target)


def _browser_page(playwright, chromium: str, team: servers.TeamTracking):
    """Debian's Chromium, never a downloaded one, logged in as the admin by basic auth."""
    browser = playwright.chromium.launch(executable_path=chromium, args=servers.CHROMIUM_FLAGS)
    admin = team.server.admin
    page = browser.new_page(
        viewport={"width": 1280, "height": 1000},
        http_credentials={"username": admin.username, "password": admin.password},
    )
    return browser, page


def _words(text: str) -> str:
    return " ".join(text.split())


def _section(page, heading: str) -> str:
    """The rendered text of the run overview's section under the heading `heading`."""
    title = page.get_by_role("heading", name=heading, exact=True).first
    return _words(title.locator("xpath=..").inner_text())


def _close_assistant(page) -> None:
    """MLflow 3.17 opens its assistant panel beside the page; a person closes it."""
    assistant = page.get_by_role("button", name="Close")
    if assistant.count():
        assistant.first.click()


def _read_run_page(page, run_url: str, shots: Path) -> dict[str, str]:
    """Overview (datasets, registered model, logged models), the datasets drawer and the
    samples table, as a person opens them; a picture of each under `shots`."""
    page.goto(run_url)
    page.get_by_text("Logged models (1)", exact=True).wait_for(timeout=90_000)
    _close_assistant(page)
    seen = {
        "datasets": _section(page, "Datasets"),
        "registered": _section(page, "Registered models"),
        "registered_link": page.get_by_role("heading", name="Registered models", exact=True)
        .first.locator("xpath=../a")
        .first.get_attribute("href"),
    }
    page.screenshot(path=str(shots / "mlflow_run.png"))
    logged = page.get_by_text("Logged models (1)", exact=True)
    logged.scroll_into_view_if_needed()
    seen["logged"] = _words(logged.locator("xpath=../..").inner_text())
    page.get_by_text("+1", exact=True).first.click()  # the second dataset's chip
    seen["more_datasets"] = _words(page.locator("body").inner_text())
    page.keyboard.press("Escape")
    page.locator("text=builtin-train-b128").first.click()  # the drawer of both datasets
    page.get_by_text("datasets used", exact=False).first.wait_for(timeout=30_000)
    seen["drawer"] = _words(page.get_by_role("dialog").first.inner_text())
    page.screenshot(path=str(shots / "mlflow_run_datasets.png"))
    page.keyboard.press("Escape")
    page.goto(f"{run_url}/artifacts/samples.json")
    page.get_by_text("View as table", exact=True).wait_for(timeout=60_000)
    # MLflow's logged-table view: a grid of ARIA rows, header cells and cells.
    page.locator("[role=cell]").first.wait_for(timeout=30_000)
    _close_assistant(page)
    seen["columns"] = page.locator("[role=columnheader]").all_inner_texts()
    seen["rows"] = page.evaluate(
        "() => Array.from(document.querySelectorAll('[role=row]'))"
        ".map(row => Array.from(row.querySelectorAll('[role=cell]')).map(c => c.innerText))"
        ".filter(cells => cells.length)"
    )
    # The table and the files beside it; the rest of the page is empty.
    page.screenshot(
        path=str(shots / "mlflow_samples.png"), clip={"x": 0, "y": 0, "width": 1280, "height": 420}
    )
    return seen


@pytest.mark.slow
def test_run_page_shows_the_model_its_datasets_and_the_samples_table(
    chromium, team, tmp_path: Path
):
    assert team.dp2.returncode == 0, servers.output(team.dp2)
    client = team.client()
    experiment = client.get_experiment_by_name("meshtrain")
    (run,) = client.search_runs(
        [experiment.experiment_id], f"tags.mlflow.runName = '{servers.DP2_LAYOUT}'"
    )
    inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    samples = json.loads(
        Path(client.download_artifacts(run.info.run_id, "samples.json", str(tmp_path))).read_text()
    )
    run_url = f"{team.server.uri}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}"

    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser, page = _browser_page(playwright, chromium, team)
        try:
            seen = _read_run_page(page, run_url, tmp_path)
        finally:
            browser.close()

    train, validation = inputs["training"], inputs["validation"]
    assert f"{train.name} ({train.digest}) Training +1" in seen["datasets"]
    assert f"{validation.name} ({validation.digest}) Validation" in seen["more_datasets"]
    assert "2 datasets used" in seen["drawer"]
    for dataset in (train, validation):
        assert f"{dataset.name} ({dataset.digest})" in seen["drawer"]
    assert f"num rows: {json.loads(train.profile)['num_rows']}" in seen["drawer"]
    assert seen["registered"] == f"Registered models {servers.REGISTERED_MODEL} v1"
    assert seen["registered_link"] == f"#/models/{servers.REGISTERED_MODEL}/versions/1"
    # The run's output: the model logged at step 0, ready, and its registered version.
    assert re.search(r"Output 0 (#\w+ )?model Ready .* meshtrain v1$", seen["logged"]), seen
    # The samples table, cell by cell as MLflow's table view renders samples.json.
    assert samples["columns"] == ["prompt", "continuation"]
    assert [_words(column) for column in seen["columns"]] == samples["columns"]
    expected = [[_words(str(cell)) for cell in row] for row in samples["data"]]
    assert [[_words(cell) for cell in row] for row in seen["rows"]] == expected
    assert len(expected) == 4
    for name in ("mlflow_run.png", "mlflow_run_datasets.png", "mlflow_samples.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    target = os.environ.get("MESHTRAIN_UI_SCREENSHOT")
    if target:  # docs/images/mlflow_compare.png: the run pictures go beside it
        for name in ("mlflow_run.png", "mlflow_run_datasets.png", "mlflow_samples.png"):
            shutil.copyfile(tmp_path / name, Path(target).with_name(name))
