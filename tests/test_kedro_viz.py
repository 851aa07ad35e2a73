"""`kedro viz build` draws the five pipelines: the static site is built in a scratch copy
of the project and opened in the headless Chromium of tests/test_mlflow_ui.py, and every
node of the default pipeline is on the page. Set MESHTRAIN_VIZ_SCREENSHOT=
docs/images/kedro_viz.png to refresh the picture in the README.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from tests import servers
from tests.kedro_project import KEDRO, make_project, project_env

NODES = [
    "build_corpus",
    "build_tokenizer",
    "pack_blocks",
    "plan_layout",
    "train_model",
    "consolidate",
    "evaluate",
]
PIPELINES = ["data_processing", "planning", "training", "consolidation", "evaluation"]


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no line per request in the test's output
        pass


@pytest.mark.slow
def test_kedro_viz_draws_the_five_pipelines(tmp_path: Path):
    servers.require(Path(servers.CHROMIUM).exists(), "chromium")
    project = make_project(tmp_path / "project")
    built = subprocess.run(
        [str(KEDRO), "viz", "build"],
        cwd=project,
        env=project_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    site = project / "build"
    main = json.loads((site / "api" / "main").read_text())
    assert [p["id"] for p in main["pipelines"]] == [*PIPELINES, "__default__"]
    assert [n["name"] for n in main["nodes"] if n["type"] == "task"] == NODES

    # The site fetches its api/ files, which a file:// page may not: serve it on loopback.
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    from playwright.sync_api import sync_playwright

    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=servers.CHROMIUM, args=servers.CHROMIUM_FLAGS
            )
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1500})
                page.goto(f"http://127.0.0.1:{server.server_port}/")
                page.locator(".pipeline-node--task").first.wait_for(timeout=90_000)
                # SVG text: textContent, not innerText. Kedro-Viz prettifies the names.
                drawn = page.locator(".pipeline-node--task").all_text_contents()
                page.wait_for_timeout(1500)  # the graph fades in
                screenshot = tmp_path / "kedro_viz.png"
                page.screenshot(path=str(screenshot))
            finally:
                browser.close()
    finally:
        server.shutdown()
    names = sorted(text.strip().lower().replace(" ", "_") for text in drawn)
    assert names == sorted(NODES), drawn
    target = os.environ.get("MESHTRAIN_VIZ_SCREENSHOT")
    if target:
        shutil.copyfile(screenshot, target)
