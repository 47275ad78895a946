"""A plain script ends promptly without `session.close()`: the Session's loop thread is stopped at
interpreter shutdown (astranb/_loopthread.py). Each case runs a real script in a subprocess."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import astranb as ab
from astranb import _loopthread
from tests.waiting import wait_until

EXIT_WITHIN = 10.0  # seconds from the script's last line to the end of its process
HANG = 120  # a hang fails the test after this long instead of hanging the suite

PRELUDE = """\
import faulthandler, sys, time
faulthandler.dump_traceback_later({dump}, exit=True)  # a hang shows where it waits
import astranb as ab

session = ab.Session("runs")
policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                        max_batch_size=16)
session.wire(ab.environments.load("arithmetic"), solver=policy)
"""

END = """
print("END", time.time(), flush=True)
"""


def run_script(tmp_path, body: str) -> tuple[float, subprocess.CompletedProcess]:
    """Run PRELUDE + body + END; return (seconds from END to the process's end, the process)."""
    script = tmp_path / "script.py"
    script.write_text(PRELUDE.format(dump=HANG - 10) + textwrap.dedent(body) + END)
    env = {**os.environ, "ASTRANB_DISPLAY": "none", "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=HANG)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"script did not exit within {HANG} s; output:\n{hung.stdout}\n{hung.stderr}")
    ended = time.time()
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit code {proc.returncode}; output:\n{output}"
    marks = [line for line in proc.stdout.splitlines() if line.startswith("END ")]
    assert marks, f"the script did not reach its end; output:\n{output}"
    gap = ended - float(marks[-1].split()[1])
    print(f"exit {gap:.2f} s after the script's end")
    return gap, proc


@pytest.mark.slow  # a real training script in a subprocess
def test_trains_waits_and_exits_without_close(tmp_path):
    gap, proc = run_script(tmp_path, """
        run = session.train(steps=2, batch_size=8, group_size=4, max_staleness=1)
        run.wait(progress=False)
        print("STATUS", run.status)
    """)
    assert "STATUS finished" in proc.stdout
    assert gap < EXIT_WITHIN


@pytest.mark.slow  # a real training script in a subprocess
def test_trains_without_waiting_stops_the_run_and_exits(tmp_path):
    # far more steps than could finish within EXIT_WITHIN: the exit stops the run
    gap, proc = run_script(tmp_path, """
        run = session.train(steps=10_000, batch_size=8, group_size=4, max_staleness=1)
    """)
    assert gap < EXIT_WITHIN
    rows = (tmp_path / "runs" / "run-000" / "metrics.jsonl")
    if rows.exists():
        assert len(rows.read_text().splitlines()) < 10_000


@pytest.mark.slow  # a real training script in a subprocess
def test_never_trains_and_exits(tmp_path):
    gap, _ = run_script(tmp_path, "")
    assert gap < EXIT_WITHIN


@pytest.mark.slow  # a real training script in a subprocess
def test_closed_explicitly_twice_and_exits(tmp_path):
    gap, proc = run_script(tmp_path, """
        run = session.train(steps=1, batch_size=8, group_size=4).wait(progress=False)
        session.close()
        session.close()  # idempotent
        with ab.Session("runs2"):
            pass
        print("STATUS", run.status)
    """)
    assert "STATUS finished" in proc.stdout
    assert gap < EXIT_WITHIN


def test_exit_hook_runs_before_concurrent_futures_joins_its_workers():
    """Threading-atexit hooks run last-registered first: ours comes after concurrent.futures'."""
    import concurrent.futures.thread as cft

    hooks = getattr(threading, "_threading_atexits", None)
    if hooks is None:
        pytest.skip("this interpreter has no threading-atexit hooks")
    _loopthread.track(_Closable())  # registers the hook (once)
    funcs = [getattr(h, "func", h) for h in hooks]
    assert _loopthread._close_all in funcs
    assert funcs.index(_loopthread._close_all) > funcs.index(cft._python_exit)
    _loopthread._live.clear()


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_hook_holds_sessions_weakly_and_forgets_closed_ones(tmp_path):
    session = ab.Session(tmp_path / "runs")
    policy = session.policy("solver", model=ab.models.tiny(hidden_size=32, num_heads=2),
                            max_batch_size=16)
    session.wire(ab.environments.load("arithmetic"), solver=policy)
    session.evaluate(n=4)  # starts the loop thread
    assert session.context in _loopthread._live.values()  # the context closes it at exit
    session.close()
    assert session.context not in _loopthread._live.values()
    session.close()  # idempotent

    session = ab.Session(tmp_path / "runs")
    session.context.loop()
    key = id(session.context)
    assert key in _loopthread._live
    del session
    gc.collect()
    assert key not in _loopthread._live

    closed = _Closable()
    _loopthread.track(closed)
    _loopthread._close_all()
    _loopthread._close_all()
    assert closed.closed == 1


class _Closable:
    closed = 0

    def close(self) -> None:
        self.closed += 1
        _loopthread.untrack(self)


def _deliverable_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.slow  # a real training script in a subprocess
def test_ctrl_c_while_waiting_exits_promptly_and_keeps_the_record(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(PRELUDE.format(dump=HANG - 10) + textwrap.dedent("""
        run = session.train(steps=10_000, batch_size=8, group_size=4, max_staleness=1)
        run.wait(progress=False)
    """))
    env = {**os.environ, "ASTRANB_DISPLAY": "none", "PYTHONUNBUFFERED": "1"}
    # A child inherits an ignored or blocked SIGINT from its parent, and earlier tests of a
    # full run leave the test process so (a kernel's launcher ignores it); a shell starts a
    # script with SIGINT deliverable, so the child gets that here too.
    print("parent: SIGINT handler", signal.getsignal(signal.SIGINT), "blocked",
          signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_deliverable_sigint)
    metrics = tmp_path / "runs" / "run-000" / "metrics.jsonl"
    deadline = time.monotonic() + HANG
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=HANG)
    gap = time.monotonic() - sent
    print(f"exit {gap:.2f} s after SIGINT")
    assert gap < EXIT_WITHIN, err[-6000:]
    # one traceback, the interrupt's, and it says the run was left going until the exit
    assert err.count("Traceback") == 1, err
    assert "KeyboardInterrupt: stopped waiting; the run goes on" in err
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(rows) >= 2 and [r["step"] for r in rows] == list(range(len(rows)))


@pytest.mark.slow  # a real training script in a subprocess
def test_a_failed_run_exits_promptly_with_its_error(tmp_path):
    script = tmp_path / "script.py"
    prelude = PRELUDE.format(dump=HANG - 10).replace(
        'session.wire(ab.environments.load("arithmetic"), solver=policy)\n', "")
    script.write_text(prelude + textwrap.dedent("""
        class Broken(ab.Environment):
            roles = ("solver",)
            def samples(self, seed):
                while True:
                    yield {"x": 1}
            async def episode(self, ctx, sample):
                raise RuntimeError("the environment is broken")
        session.wire(Broken(), solver=policy)
        run = session.train(steps=3, batch_size=8, group_size=4)
        try:
            run.wait(progress=False)
        finally:
            print("END", time.time(), flush=True)
    """))
    env = {**os.environ, "ASTRANB_DISPLAY": "none", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=HANG)
    ended = time.time()
    marks = [line for line in proc.stdout.splitlines() if line.startswith("END ")]
    assert marks, proc.stdout + proc.stderr
    assert ended - float(marks[-1].split()[1]) < EXIT_WITHIN
    assert proc.returncode == 1
    assert "the environment is broken" in proc.stderr
    assert "Exception ignored" not in proc.stderr and "terminate called" not in proc.stderr


@pytest.mark.slow  # a real kernel
def test_interrupting_await_run_in_a_kernel_stops_the_waiting_not_the_run(tmp_path):
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        def execute(code: str, timeout: float = HANG) -> dict:
            outputs: list[dict] = []
            reply = kc.execute_interactive(code, timeout=timeout,
                                           output_hook=lambda msg: outputs.append(msg))
            return {"reply": reply["content"], "outputs": outputs}

        def value(code: str) -> str:
            result = execute(code)
            assert result["reply"]["status"] == "ok", result["reply"]
            texts = [m["content"]["data"]["text/plain"] for m in result["outputs"]
                     if m["msg_type"] == "execute_result"]
            return texts[-1]

        setup = "import astranb as ab\n" + PRELUDE.split("import astranb as ab\n", 1)[1]
        assert execute("import os; os.environ['ASTRANB_DISPLAY'] = 'none'\n" + setup
                       )["reply"]["status"] == "ok"
        execute("run = session.train(steps=10_000, batch_size=8, group_size=4)")
        msg_id = kc.execute("await run", stop_on_error=False)  # later cells are not aborted
        time.sleep(3)
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=HANG)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=HANG)
        assert reply["content"]["status"] == "error"
        assert "the run goes on in the background" in reply["content"]["evalue"]
        assert value("run.status") == "'running'"
        steps = int(value("len(run.rows)"))
        wait_until(lambda: int(value("len(run.rows)")) > steps, 60,  # it still trains
                   "a step after the interrupt", interval=0.2)
        execute("run.stop()\nimport time\nwhile run.status == 'running': time.sleep(0.1)")
        assert value("run.status") == "'stopped'"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
