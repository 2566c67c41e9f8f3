"""What a person sees, checked in a real browser: the report of a finished run and the MLflow UI served from
its store, opened in headless Chromium (Debian's `chromium`, driven by Playwright with that executable; no
browser download). Skipped, with the reason, where either is missing. Screenshots go to $M2D_SCREENSHOTS
(benchmarks/screenshots/ for RESULTS.md), else to the test's temporary directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from small_run import finished_run

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (Debian: apt-get install -y chromium)")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install -e '.[test]')")

#: the one console error MLflow's own UI logs on a plain `mlflow ui`: its probe for the auth plugin's current user (404)
MLFLOW_OWN_404 = "/ajax-api/2.0/mlflow/users/current"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict]:
    return finished_run(tmp_path_factory.mktemp("browser") / "run")


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    out = Path(os.environ.get("M2D_SCREENSHOTS") or tmp_path_factory.mktemp("shots"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])  # root in containers needs no sandbox
        yield b
        b.close()


def _console(page) -> list[tuple[str, str]]:
    """(text, url) of every console error and uncaught exception of `page`, as they come."""
    errors: list[tuple[str, str]] = []
    page.on("console", lambda m: errors.append((m.text, m.location.get("url", ""))) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append((str(e), "")))
    return errors


@contextlib.contextmanager
def mlflow_ui(store: str, timeout: float = 120.0):
    """`mlflow ui` on 127.0.0.1 and a free port, up to `timeout` s to answer /health; stopped (its process group) on
    exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job runner for a viewer
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "ui",
            "--backend-store-uri",
            store,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(
                        f"mlflow ui did not answer within {timeout:.0f} s: "
                        f"{proc.stderr.read().decode()[-500:] if proc.poll() is not None else 'still starting'}"
                    )
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_report_page_loads_every_image_without_console_errors(run, browser, shots):
    _, result = run
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = _console(page)
    page.goto(Path(result["report"]).as_uri(), wait_until="load")
    images = page.eval_on_selector_all(
        "img", "els => els.map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])"
    )
    assert len(images) == 6 and all(ok for _, ok in images), images
    assert "categories.png" in [src for src, _ in images]  # the paper's figure of what the models write
    captions = page.eval_on_selector_all("figure > figcaption", "els => els.map(e => e.innerText)")
    assert len(captions) == len(images) and all(len(c) > 40 for c in captions)
    assert errors == []
    page.screenshot(path=str(shots / "report.png"), full_page=True)
    page.close()


def test_mlflow_ui_opens_on_the_runs_table_with_configs_and_students(run, browser, shots):
    from m2d_ray.run_dir import RunDir

    run_dir, result = run
    rd = RunDir(run_dir)
    page = browser.new_page(viewport={"width": 1800, "height": 1000})
    errors = _console(page)
    with mlflow_ui(f"sqlite:///{run_dir / 'mlflow.db'}") as url:
        page.goto(result["mlflow_url"].replace("http://127.0.0.1:5000", url))  # the link m2d run prints, on this port
        configs = [r["key"] for r in rd.stage1_ledger().records()]
        students = [f"stage2/{r['key']}" for r in rd.stage2_records()]
        for name in configs + students:  # grouped by stage, each group open: no expanding, no choosing columns
            page.get_by_text(name, exact=True).first.wait_for(timeout=60_000)
        body = page.inner_text("body")
        for column in ("perplexity", "final_val_ppl", "mean_acc", "K", "scaling"):
            assert column in body.split("\n"), column
        assert "Group by: stage" in body and "matching runs" in body
        for close in page.locator(
            "[data-component-id='mlflow.assistant.chat_panel.close']"
        ).all():  # MLflow's assistant panel, for room
            close.click()
        page.get_by_text("kind", exact=True).first.wait_for(timeout=10_000)  # the tag columns, once there is room
        page.screenshot(path=str(shots / "mlflow_runs.png"))
        page.goto(
            result["mlflow_url"].replace("http://127.0.0.1:5000", url) + "&compareRunsMode=CHART"
        )  # the chart view beside it
        page.get_by_text("Parallel Coordinates").first.wait_for(timeout=30_000)
        for axis in (
            "K",
            "scaling",
            "perplexity",
            "final_val_ppl",
            "mean_acc",
        ):  # the grid against stage 1, the students' metrics
            page.get_by_text(axis, exact=True).first.wait_for(timeout=10_000)
        page.screenshot(path=str(shots / "mlflow_charts.png"))
    page.close()
    assert [e for e in errors if not e[1].endswith(MLFLOW_OWN_404)] == []
