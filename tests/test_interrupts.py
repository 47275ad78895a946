"""Ctrl-C and the kernel's stop button stop the waiting, never the run; what astranb starts dies
with the process that started it (astranb/lifeline.py, astranb/_kernel.py).

Everything here runs real processes: a script whose own process group gets SIGINT, a Jupyter
kernel interrupted through jupyter_client, `astranb run` stopped by Ctrl-C, and parents killed
with SIGKILL. Each script runs in a session of its own, so no signal reaches pytest.
"""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from astranb import _kernel, lifeline
from tests.waiting import wait_until

HANG = 150  # a hang fails the test after this long instead of hanging the suite
GONE_WITHIN = 30.0  # seconds a child may take to end once its parent is gone

SESSION = """\
import astranb as ab
session = ab.Session("runs", trainer="process")
policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                        max_batch_size=16)
session.wire(ab.environments.load("arithmetic"), solver=policy)
"""

# A Python whose SIGINT is Python's own handler even when this test runs under a shell that
# ignores SIGINT in background jobs (an ignored SIGINT is inherited and kept by Python).
WITH_CTRL_C = "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "


def _env() -> dict[str, str]:
    return {**os.environ, "ASTRANB_DISPLAY": "none", "PYTHONUNBUFFERED": "1"}


def _gone(pid: int) -> bool:
    """Whether the process has ended (a zombie nobody reaped counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _first_step(folder: Path) -> bool:
    rows = folder / "runs" / "run-000" / "metrics.jsonl"
    return rows.is_file() and rows.stat().st_size > 0


# -- (b) SIGINT to a script's process group -------------------------------------------------------

SCRIPT = SESSION + """\
import os, signal, threading, time
run = session.train(steps=100_000, batch_size=8, group_size=4, max_staleness=1)

waiting = threading.Event()

def press():  # Ctrl-C in the terminal: SIGINT to the whole foreground process group
    waiting.wait()  # the main thread is about to wait on the run; one more step and it does
    at = run.progress[0]
    while run.progress[0] < max(at + 1, 1):
        time.sleep(0.02)
    os.killpg(os.getpgrp(), signal.SIGINT)

threading.Thread(target=press, daemon=True).start()
try:
    waiting.set()
    run.wait(progress=False)
except KeyboardInterrupt as interrupt:
    print("INTERRUPTED", interrupt, flush=True)
at, deadline = run.progress[0], time.monotonic() + 60
while run.progress[0] < at + 2 and run.status == "running" and time.monotonic() < deadline:
    time.sleep(0.02)
print("AFTER", run.status, run.progress[0] - at, flush=True)
run.stop()
run.wait(progress=False)
print("STOPPED", run.status, flush=True)
again = session.train(steps=2, batch_size=8, group_size=4, max_staleness=1)
again.wait(progress=False)
print("AGAIN", again.status, flush=True)
"""


@pytest.mark.slow  # a training script in a subprocess
def test_sigint_to_a_scripts_process_group_stops_the_waiting_not_the_run(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-c", WITH_CTRL_C + "exec(open('script.py').read())"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=HANG, start_new_session=True)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "INTERRUPTED stopped waiting; the run goes on" in proc.stdout, output
    after = next(line.split() for line in proc.stdout.splitlines() if line.startswith("AFTER"))
    assert after[1] == "running" and int(after[2]) >= 2, output  # it trained on after Ctrl-C
    assert "STOPPED stopped" in proc.stdout, output
    assert "AGAIN finished" in proc.stdout, output


# -- (a) the kernel's stop button -----------------------------------------------------------------

def _execute(client, code: str, value: str | None = None) -> tuple[dict, str]:
    """Run `code` in the kernel; (its reply's content, its printed text), or with `value` (an
    expression) that expression's str() read from the reply itself instead of the printed text:
    the reply always names its request, while ipykernel may file a cell's output under the
    interrupted cell before it."""
    printed: list[str] = []

    def keep(message):
        if message["msg_type"] == "stream":
            printed.append(message["content"]["text"])

    expressions = {"value": f"str({value})"} if value else {}
    reply = client.execute_interactive(code, timeout=HANG, output_hook=keep,
                                       user_expressions=expressions)
    content = reply["content"]
    if value and content["status"] == "ok":
        shown = content["user_expressions"]["value"]
        assert shown["status"] == "ok", shown
        return content, ast.literal_eval(shown["data"]["text/plain"])
    return content, "".join(printed)


@pytest.mark.slow  # a real kernel
def test_the_kernels_stop_button_during_await_run_leaves_the_run_going(tmp_path):
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(cwd=str(tmp_path), env=_env())
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=60)
        content, printed = _execute(client, SESSION)
        assert content["status"] == "ok", content
        waiting = client.execute("run = session.train(steps=100_000, batch_size=8, group_size=4, "
                                 "max_staleness=1)\nawait run")
        wait_until(lambda: _first_step(tmp_path), HANG, "a training step")
        manager.interrupt_kernel()  # what Jupyter's stop button does
        reply = client.get_shell_msg(timeout=HANG)
        assert reply["parent_header"]["msg_id"] == waiting
        assert reply["content"]["status"] == "error"
        assert "the run goes on" in reply["content"]["evalue"], reply["content"]

        content, printed = _execute(client, textwrap.dedent("""\
            import time
            at, deadline = run.progress[0], time.monotonic() + 60
            while run.progress[0] < at + 2 and run.status == "running" \\
                    and time.monotonic() < deadline:
                time.sleep(0.02)
            """), value="f'{run.status} {run.progress[0] - at}'")
        assert content["status"] == "ok", (content, printed)
        status, steps = printed.split()
        assert status == "running" and int(steps) >= 2, printed  # the kernel works, the run too
        content, printed = _execute(client, "run.stop()\nawait run", value="run.status")
        assert printed.strip() == "stopped", (content, printed)
        content, printed = _execute(client, "again = session.train(steps=2, batch_size=8, "
                                            "group_size=4, max_staleness=1)\nawait again",
                                    value="again.status")
        assert printed.strip() == "finished", (content, printed)
    finally:
        client.stop_channels()
        children = psutil.Process(manager.provisioner.pid).children(recursive=True)
        manager.shutdown_kernel(now=False)
        wait_until(lambda: all(_gone(c.pid) for c in children), GONE_WITHIN,
                   "the kernel's children to end with it")


# -- (c) `astranb run` stopped by Ctrl-C ----------------------------------------------------------

def _training_notebook(folder: Path) -> Path:
    cells = [new_code_cell(SESSION),
             new_code_cell("run = session.train(steps=100_000, batch_size=8, group_size=4, "
                           "max_staleness=1)\nawait run"),
             new_code_cell("print('NEVER REACHED')")]
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    path = folder / "train.ipynb"
    nbformat.write(notebook, path)
    return path


def _astranb_run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    code = WITH_CTRL_C + "from astranb.cli import main; sys.exit(main())"
    return subprocess.Popen([sys.executable, "-c", code, "run", *args], cwd=cwd,
                            env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


@pytest.mark.slow  # a real kernel, training
def test_ctrl_c_stops_astranb_run_cleanly_and_leaves_no_process(tmp_path):
    _training_notebook(tmp_path)
    proc = _astranb_run("train.ipynb", "-o", "out", cwd=tmp_path)
    try:
        wait_until(lambda: _first_step(tmp_path), HANG, "a training step")
        started = psutil.Process(proc.pid).children(recursive=True)  # kernel, trainer
        assert any("_trainer_child" in " ".join(p.cmdline()) for p in started)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in the terminal it runs in
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopped by Ctrl-C in cell In [2]" in err, err
    assert "Traceback" not in err, err
    executed = nbformat.read(tmp_path / "out" / "train.ipynb", as_version=4)
    code = [cell for cell in executed.cells if cell.cell_type == "code"]
    assert code[1].outputs, "the interrupted cell's outputs are kept"
    assert code[2].source == "print('NEVER REACHED')" and not code[2].outputs  # never ran
    assert (tmp_path / "out" / "train.html").is_file()
    try:
        wait_until(lambda: all(_gone(p.pid) for p in started), GONE_WITHIN,
                   "the kernel and the trainer to end with `astranb run`")
    finally:
        _kill_all(p.pid for p in started)


@pytest.mark.slow  # a real kernel
def test_after_ctrl_c_no_further_cell_runs_even_when_the_cell_catches_it(tmp_path):
    cells = [new_code_cell("import pathlib, time\npathlib.Path('started').touch()\ntry:\n"
                           "    time.sleep(120)\nexcept KeyboardInterrupt:\n    print('caught')"),
             new_code_cell("print('NEVER REACHED')")]
    notebook = new_notebook(cells=cells)
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    nbformat.write(notebook, tmp_path / "catch.ipynb")
    proc = _astranb_run("catch.ipynb", "-o", "out", cwd=tmp_path)
    try:
        wait_until(lambda: (tmp_path / "started").exists(), HANG, "the cell to start")
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "stopped by Ctrl-C after cell In [1]" in err, err
    code = [cell for cell in nbformat.read(tmp_path / "out" / "catch.ipynb", as_version=4).cells
            if cell.cell_type == "code"]
    assert "caught" in code[0].outputs[0]["text"]
    assert not code[1].outputs


@pytest.mark.slow  # a real kernel
def test_astranb_run_starts_a_quiet_kernel_on_sockets_of_its_own(tmp_path):
    cell = new_code_cell("import os\nprint(6 * 7, os.environ['TMPDIR'])")
    notebook = new_notebook(cells=[cell])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    nbformat.write(notebook, tmp_path / "quiet.ipynb")
    temp = Path(tempfile.mkdtemp(prefix="ab"))  # short: socket paths have a length limit
    try:
        proc = _astranb_run("quiet.ipynb", "-o", "out", cwd=tmp_path,
                            env={**_env(), "TMPDIR": str(temp)})
        out, err = proc.communicate(timeout=HANG)
        assert proc.returncode == 0, err
        assert f"42 {temp}" in (tmp_path / "out" / "quiet.ipynb").read_text()
        assert "without encryption" not in out + err, err
        assert list(temp.iterdir()) == []  # its socket folder is gone
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "quiet.ipynb"]
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def test_ipc_only_where_socket_paths_fit():
    assert _kernel.ipc_fits("/tmp") == (os.name == "posix")
    assert not _kernel.ipc_fits("/" + "x" * 80)


# -- (d) children die with their parent -----------------------------------------------------------

PARENT = """\
import os, sys, subprocess, threading, time
import anyio
import astranb as ab
from astranb import _kernel, lifeline
from astranb.remote.process import ProcessTrainer
from astranb.services.local import LocalService
from astranb_math.verify import AnswerVerifier

trainer = ProcessTrainer("p", ab.models.tiny(hidden_size=32, num_heads=2), ab.GRPO(),
                         ab.AdamWConfig(), log="trainer.log")
# a program astranb cannot change (the SGLang server), started through astranb.lifeline
wrapped = subprocess.Popen([sys.executable, lifeline.__file__, "sleep", "600"],
                           **lifeline.shielded())
service = LocalService("rollout", ["--engine", "instant"], "service.log").start()
verifier = AnswerVerifier(timeout=600)  # a check stuck in math-verify, as on a hostile answer
threading.Thread(target=anyio.run, args=(verifier.check, "\\\\hang", "2"), daemon=True).start()
import psutil
while not ("sleep" in {p.name() for p in psutil.Process().children(recursive=True)}
           and any("_verify_worker.py" in " ".join(p.cmdline())
                   for p in psutil.Process().children())):
    time.sleep(0.02)  # every child has started
# a process forked from this one (a DataLoader worker, a multiprocessing pool) holds the
# trainer's pipes open, so the trainer never sees its input end
if os.fork() == 0:
    time.sleep(600)
    os._exit(0)
print("READY", flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # a process tree of services, verifier and trainer
def test_what_astranb_starts_ends_when_its_parent_is_killed(tmp_path):
    (tmp_path / "parent.py").write_text(PARENT)
    env = {**_env(), "ASTRANB_MATH_VERIFY_HANG_ON": "\\hang"}
    parent = subprocess.Popen([sys.executable, "parent.py"], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "READY"
        tree = psutil.Process(parent.pid).children(recursive=True)
        lines = {p: " ".join(p.cmdline()) for p in tree}

        def started(part: str) -> psutil.Process:
            found = [p for p, line in lines.items() if part in line]
            assert found, f"no child running {part!r} among {list(lines.values())}"
            return found[0]

        children = [started("astranb.remote._trainer_child"), started("_verify_worker.py"),
                    started("astranb.cli serve rollout"), started("lifeline.py"),
                    *[p for p in tree if p.name() == "sleep"]]
        assert len(children) == 5, lines
        parent.kill()
        parent.wait()
        wait_until(lambda: all(_gone(c.pid) for c in children), GONE_WITHIN,
                   lambda: "every child to end with its parent; still alive: " + ", ".join(
                       lines[c] for c in children if not _gone(c.pid)))
    finally:  # the forked process still holds the parent's output: no communicate()
        parent.kill()
        parent.wait()
        _kill_all(p.pid for p in tree)
        parent.stdout.close()


def test_shielded_children_have_a_session_of_their_own_and_know_their_parent():
    options = lifeline.shielded({"A": "1"})
    assert options["start_new_session"] is True
    assert options["env"] == {"A": "1", lifeline.PARENT_ENV: str(os.getpid())}
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getsid(0), os.getpgrp(), os.getpid())"],
        capture_output=True, text=True, check=True, **lifeline.shielded())
    session, group, pid = map(int, child.stdout.split())
    assert session == group == pid != os.getpgrp()


def test_the_lifeline_runner_ends_with_its_command_when_the_group_is_stopped():
    # how the SGLang server is stopped: SIGTERM to its group, then the runner reports its status
    runner = subprocess.Popen([sys.executable, lifeline.__file__, "sleep", "60"],
                              **lifeline.shielded())
    try:
        wait_until(lambda: any(p.name() == "sleep"
                               for p in psutil.Process(runner.pid).children()),
                   30, "the command to start")
        os.killpg(runner.pid, signal.SIGTERM)
        assert runner.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)
        runner.wait()
