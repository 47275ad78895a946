"""The quickstart in a real browser: JupyterLab started here, driven by Playwright in Debian's
headless Chromium (installed by .ci/run; no browser is downloaded). Runs every cell, waits for the
live dashboard to draw data, keeps a screenshot, and checks that Stop stops the run.

Skips when chromium is not installed, unless ASTRANB_REQUIRE_BROWSER=1 (CI sets it): then a
missing browser is a failure, not a silent skip.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("ASTRANB_ARTIFACTS", ROOT / "test-artifacts"))

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        message = ("Debian's chromium is not installed: `apt-get install -y chromium` "
                   "(bash .ci/run does it)")
        if os.environ.get("ASTRANB_REQUIRE_BROWSER") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _notebook(tmp_path: Path) -> Path:
    """The quickstart with parameters for a run that lasts until Stop is clicked."""
    nb = json.loads((ROOT / "notebooks" / "01_quickstart.ipynb").read_text())
    params = next(c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", []))
    source = "".join(params["source"])
    for name, value in {"steps": "5000", "batch_size": "16", "eval_episodes": "16",
                        "run_dir": repr(str(tmp_path / "run")),
                        "results_dir": repr(str(tmp_path / "results"))}.items():
        source, n = re.subn(rf"(?m)^{name} = .*$", f"{name} = {value}", source)
        assert n == 1, f"parameter {name} not found in the quickstart's parameters cell"
    params["source"] = source
    path = tmp_path / "lab" / "quickstart.ipynb"
    path.parent.mkdir()
    path.write_text(json.dumps(nb))
    return path


@pytest.fixture
def jupyterlab(tmp_path):
    token, port = secrets.token_hex(16), _free_port()
    notebook = _notebook(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("ASTRANB_SMOKE", "ASTRANB_DISPLAY")}
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "jupyter-config")
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={notebook.parent}",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}", "--ServerApp.open_browser=False",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=notebook.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                log.close()
                os.killpg(server.pid, signal.SIGKILL) if server.poll() is None else None
                log_text = (tmp_path / "jupyterlab.log").read_text()
                pytest.fail("JupyterLab did not start:\n" + log_text[-3000:])
            time.sleep(0.5)
    try:
        yield f"{base}/lab/tree/{notebook.name}?reset&token={token}"
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the kernel is in the server's process group
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def _status(page) -> str:
    return page.locator(".astranb-dashboard .astranb-status").inner_text(timeout=5_000)


def _steps(status: str) -> int:
    match = re.search(r"(\d+)/\d+ steps", status)
    return int(match.group(1)) if match else -1


def test_quickstart_dashboard_in_jupyterlab(chromium, jupyterlab, tmp_path):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync"],
        )
        page = browser.new_page(viewport={"width": 1600, "height": 1200})
        try:
            page.goto(jupyterlab)
            page.locator(".jp-Notebook").wait_for(timeout=120_000)
            page.locator("#jp-main-statusbar", has_text="Idle").wait_for(timeout=120_000)
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()

            # the live dashboard appears and draws steps
            page.locator(".astranb-dashboard .js-plotly-plot").wait_for(timeout=300_000)
            deadline = time.monotonic() + 300
            while _steps(_status(page)) < 3:
                assert time.monotonic() < deadline, f"no steps drawn: {_status(page)!r}"
                time.sleep(1)
            status = _status(page)
            assert status.startswith("running"), status
            # every reward point drawn: the line's path has as many vertices as steps (or more)
            paths = page.locator(".astranb-dashboard .js-plotly-plot .scatterlayer .trace "
                                 "path.js-line")
            drawn = [d for d in (paths.nth(i).get_attribute("d") for i in range(paths.count()))
                     if d]
            assert drawn, "the dashboard's plots hold no lines"
            assert max(d.count("L") for d in drawn) >= 2
            time.sleep(1.5)  # let the next redraw land before the screenshot
            page.locator(".astranb-dashboard").screenshot(
                path=str(ARTIFACTS / "browser_dashboard.png"))

            # Stop stops the run; the notebook's remaining cells then run to the end
            page.locator(".astranb-dashboard button", has_text="Stop").click()
            page.locator(".astranb-dashboard .astranb-status",
                         has_text="stopped").wait_for(timeout=60_000)
            stopped_at = _steps(_status(page))
            assert 3 <= stopped_at < 5000
            page.get_by_text("random-policy baseline reward").first.wait_for(timeout=10_000)
            page.locator(".jp-OutputArea-output",
                         has_text="'final_eval'").first.wait_for(timeout=180_000)
            assert _steps(_status(page)) == stopped_at
            page.screenshot(path=str(ARTIFACTS / "browser_notebook.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "browser_failure.png"), full_page=True)
            raise
        finally:
            browser.close()


def test_exported_episode_steps_in_a_browser_without_a_kernel(chromium, tmp_path):
    """The debugger's HTML export opens from a file, makes no request, and steps with the
    buttons and the arrow keys."""
    from playwright.sync_api import sync_playwright

    import astranb as ab
    from tests.envs import ToolBetween
    from tests.test_debugger import SAMPLE, scripted

    dbg = ab.debug(ToolBetween(), SAMPLE, solver=scripted("p", "aab", "3"))
    path = dbg.export_html(tmp_path / "episode.html")
    kinds = [s.kind for s in dbg.steps]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True,
                                    args=["--no-sandbox", "--disable-gpu",
                                          "--disable-background-networking"])
        page = browser.new_page()
        errors, requests = [], []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("request", lambda request: requests.append(request.url))
        page.goto(path.as_uri())
        current = page.locator(".astranb-step.current")

        def shown() -> tuple[int, str]:
            assert current.count() == 1, "exactly one step is shown at a time"
            return int(current.get_attribute("data-step")), current.get_attribute("data-kind")

        assert shown() == (0, kinds[0])
        page.locator(".next").click()
        assert shown() == (1, kinds[1])
        page.keyboard.press("ArrowRight")
        assert shown() == (2, kinds[2])
        page.keyboard.press("ArrowLeft")
        page.locator(".prev").click()
        assert shown() == (0, kinds[0])
        page.locator(".outline button").last.click()
        assert shown() == (len(kinds) - 1, "reward")
        browser.close()
    assert not errors, errors
    assert requests == [path.as_uri()], f"the page asked for more than itself: {requests}"
