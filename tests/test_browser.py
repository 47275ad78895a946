"""The quickstart in a real browser: JupyterLab started here, driven by Playwright in Debian's
headless Chromium (installed by .ci/run; no browser is downloaded). Runs every cell, waits for the
live dashboard to draw data, keeps a screenshot, and checks that Stop stops the run.

Skips when chromium is not installed, unless ASTRANB_REQUIRE_BROWSER=1 (CI sets it): then a
missing browser is a failure, not a silent skip.
"""

from __future__ import annotations

import contextlib
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
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.waiting import wait_until

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


@contextlib.contextmanager
def _lab(root: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """JupyterLab serving `root` on a free loopback port: yields (base URL, token)."""
    token, port = secrets.token_hex(16), _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("ASTRANB_SMOKE", "ASTRANB_DISPLAY")}
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "jupyter-config")
    log = open(tmp_path / "jupyterlab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={root}",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}", "--ServerApp.open_browser=False",
         *(["--allow-root"] if os.geteuid() == 0 else [])],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
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
        yield base, token
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the kernel is in the server's process group
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


@pytest.fixture
def jupyterlab(tmp_path):
    notebook = _notebook(tmp_path)
    with _lab(notebook.parent, tmp_path) as (base, token):
        yield f"{base}/lab/tree/{notebook.name}?reset&token={token}"


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
            wait_until(lambda: _steps(_status(page)) >= 3, 300,
                       lambda: f"3 steps drawn (status: {_status(page)!r})", interval=1)
            status = _status(page)
            assert status.startswith("running"), status
            # every reward point drawn: the line's path has as many vertices as steps (or more)
            paths = page.locator(".astranb-dashboard .js-plotly-plot .scatterlayer .trace "
                                 "path.js-line")
            drawn = [d for d in (paths.nth(i).get_attribute("d") for i in range(paths.count()))
                     if d]
            assert drawn, "the dashboard's plots hold no lines"
            assert max(d.count("L") for d in drawn) >= 2
            drawn_steps = _steps(status)  # let the next redraw land before the screenshot
            wait_until(lambda: _steps(_status(page)) > drawn_steps, 120, "the next redraw",
                       interval=0.5)
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


# -- every notebook, as a person runs it: Run All with its own defaults ------------------------
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
STATED = re.compile(r"Run All finishes within (\d+) minutes on 2 CPU cores")
IDLE_SECONDS = 5.0
"""The kernel idle this long: Run All may be over (the saved notebook says whether it is)."""


def _stated_minutes(path: Path) -> int:
    """The time a notebook says Run All takes (in its first markdown cell)."""
    first = next(c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown")
    match = STATED.search("".join(first["source"]))
    assert match, f"{path.name} does not say 'Run All finishes within N minutes on 2 CPU cores'"
    return int(match.group(1))


def test_every_notebook_states_how_long_run_all_takes():
    assert {name: _stated_minutes(ROOT / "notebooks" / name) for name in NOTEBOOKS}


@pytest.fixture(scope="module")
def notebooks_lab(tmp_path_factory) -> Iterator[tuple[str, str, Path]]:
    """One JupyterLab over a copy of notebooks/ (their run folders land beside the copy)."""
    tmp = tmp_path_factory.mktemp("all-notebooks")
    root = tmp / "lab" / "notebooks"
    shutil.copytree(ROOT / "notebooks", root)
    with _lab(root, tmp) as (base, token):
        yield base, token, root


def _api(base: str, token: str, path: str, method: str = "GET"):
    request = urllib.request.Request(f"{base}{path}?token={token}", method=method)
    with urllib.request.urlopen(request, timeout=10) as answer:
        body = answer.read()
    return json.loads(body) if body else None


def _kernel_state(base: str, token: str, name: str) -> tuple[str | None, str | None]:
    """(session id, the kernel's execution state) of the notebook `name`'s session."""
    for session in _api(base, token, "/api/sessions"):
        if session["path"].endswith(name):
            return session["id"], session["kernel"]["execution_state"]
    return None, None


def _progress(path: Path) -> tuple[int, int, str | None]:
    """(code cells executed, code cells, the first error's text) of the saved notebook."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    errors = [f"{o['ename']}: {o['evalue']}" for c in cells for o in c.get("outputs", ())
              if o.get("output_type") == "error"]
    done = sum(c.get("execution_count") is not None for c in cells)
    return done, len(cells), errors[0] if errors else None


@pytest.mark.runall
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_run_all_with_its_own_defaults_finishes_within_the_stated_time(
        chromium, notebooks_lab, name):
    """A person's first contact: open the notebook in JupyterLab, Run All, no parameters. Every
    cell runs without an error, within the time the notebook states."""
    from playwright.sync_api import sync_playwright

    base, token, root = notebooks_lab
    minutes = _stated_minutes(root / name)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        session = None
        try:
            page.goto(f"{base}/lab/tree/{name}?reset&token={token}")
            page.locator(".jp-Notebook").wait_for(timeout=120_000)
            page.locator("#jp-main-statusbar", has_text="Idle").wait_for(timeout=120_000)
            started = time.monotonic()
            page.get_by_role("menuitem", name="Run", exact=True).click()
            page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
            idle_since = None
            while True:
                elapsed = time.monotonic() - started
                assert elapsed < minutes * 60, (
                    f"{name}: Run All still going after {elapsed:.0f} s; it states "
                    f"{minutes} minutes ({_progress(root / name)[:2]} cells done at last save)")
                time.sleep(1)
                session, state = _kernel_state(base, token, name)
                if state != "idle":
                    idle_since = None
                    continue
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since < IDLE_SECONDS:
                    continue
                page.locator(".jp-Notebook").first.click()
                page.keyboard.press("Control+s")
                time.sleep(1)
                done, total, error = _progress(root / name)
                assert error is None, f"{name}: a cell failed with its own defaults: {error}"
                if done == total:
                    break
                idle_since = None  # idle between two cells, or the save was not in yet
            print(f"{name}: Run All took {time.monotonic() - started:.0f} s "
                  f"(states {minutes} min)")
        except Exception:
            page.screenshot(path=str(ARTIFACTS / f"browser_run_all_{name}.png"), full_page=True)
            raise
        finally:
            browser.close()
            if session is not None:  # its kernel's memory and threads go before the next one
                _api(base, token, f"/api/sessions/{session}", method="DELETE")
