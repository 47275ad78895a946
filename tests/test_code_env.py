"""The code environment: task forms, the sandbox's rewards and containment (hostile programs end
only their episode and leave the host unharmed), the pool off the event loop, and both
environments played through the real EpisodeContext with scripted engines."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import time

import anyio
import pytest
from astranb_code import (
    Code,
    CodeVerifier,
    Limits,
    Sandbox,
    TaskError,
    extract_code,
    normalize,
    read_prediction,
    synthetic_tasks,
)

import astranb as ab
from tests.test_math_env import play, scripted
from tests.waiting import wait_until

ADD = "def add(a, b):\n    return a + b"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4",
         "assert add(0, 5) == 5"]
FAST = Limits(wall_seconds=5, cpu_seconds=2, memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(FAST, concurrency=2)


def run(sandbox, program, tests=TESTS, **kw):
    return anyio.run(lambda: sandbox.run(program, tests, **kw))


# -- rewards --------------------------------------------------------------------------------------

@pytest.mark.parametrize("program, passed, error", [
    (ADD, 4, None),                                                        # right
    ("def add(a, b):\n    return a * b", 1, "a test failed: AssertionError"),  # wrong
    ("def add(a, b):\n    return a + b if a else 0", 3, "a test failed"),  # partial
    ("def add(a, b)\n    return a + b", 0, "the program failed: SyntaxError"),  # malformed
    ("def plus(a, b):\n    return a + b", 0, "NameError"),                 # wrong name
    ("raise SystemExit(3)", 0, "the program failed: SystemExit"),
])
def test_the_score_is_the_share_of_tests_passed(sandbox, program, passed, error):
    result = run(sandbox, program)
    assert (result.passed, result.total) == (passed, 4)
    assert result.fraction == passed / 4
    if error is None:
        assert result.error is None
    else:
        assert error in result.error
    assert not result.timed_out


def test_setup_runs_before_the_program_and_output_is_kept_bounded(sandbox):
    result = run(sandbox, "def root(x):\n    print('x' * 100000)\n    return math.sqrt(x)",
                 ["assert root(16) == 4"], setup="import math")
    assert result.passed == 1 and result.stdout == "x" * FAST.output_bytes


# -- containment ----------------------------------------------------------------------------------

def _processes_of(limits):
    """Processes whose command line carries `limits` (the jail's config does): this test's own
    jobs, not those of a test run beside it."""
    marker = f'"file_bytes": {limits.file_bytes}'
    return {p for p in os.listdir("/proc") if p.isdigit() and marker in _cmdline(p)}


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow  # waits out the sandbox's time limit
def test_an_infinite_loop_is_killed(sandbox):
    result = run(sandbox, "while True:\n    pass")
    assert result.passed == 0
    assert "SIGXCPU" in result.error or result.timed_out
    sleeper = run(sandbox, "import time\ntime.sleep(60)")
    assert sleeper.timed_out and "timed out after 5 s" in sleeper.error
    assert sleeper.seconds < 8


@pytest.mark.slow  # a fork bomb and its clean-up
def test_a_fork_bomb_is_contained_and_leaves_nothing_behind(sandbox):
    marked = dataclasses.replace(FAST, file_bytes=(1 << 20) + os.getpid() % 100_000)
    result = run(sandbox, "import os\nwhile True:\n    try:\n        os.fork()\n"
                          "    except OSError:\n        pass", limits=marked)
    assert result.passed == 0 and result.error
    wait_until(lambda: not _processes_of(marked), 10,
               lambda: f"the fork bomb's processes to end: {_processes_of(marked)}")
    assert run(sandbox, ADD).passed == 4


def test_a_memory_bomb_hits_the_address_space_limit(sandbox):
    result = run(sandbox, "blocks = []\nwhile True:\n    blocks.append(bytearray(50 << 20))")
    assert result.passed == 0 and "MemoryError" in result.error


def test_writes_outside_the_job_directory_are_refused(sandbox, tmp_path):
    target = tmp_path / "escaped.txt"
    tmp_path.chmod(0o777)
    result = run(sandbox, f"open({str(target)!r}, 'w').write('pwned')")
    assert result.passed == 0 and "PermissionError" in result.error
    assert not target.exists()
    inside = run(sandbox, "open('scratch.txt', 'w').write('ok')\n" + ADD)  # its own dir is fine
    assert inside.passed == 4


def test_no_connection_leaves_the_sandbox(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    result = run(sandbox, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)")
    # a connection the program made is in the listen queue before its connect() returned, so
    # before run() did: one look now sees it, with no wait for one that may yet come
    server.setblocking(False)
    arrived = []
    with contextlib.suppress(BlockingIOError):
        arrived.append(server.accept())
    server.close()
    assert arrived == [] and result.passed == 0


def test_the_program_cannot_signal_its_parent(sandbox):
    result = run(sandbox, "import os\nos.kill(os.getppid(), 9)\n" + ADD)
    assert result.passed == 0 and "PermissionError" in result.error
    assert run(sandbox, ADD).passed == 4  # we are still here, and so is the pool


def test_the_isolation_layers_are_reported(sandbox):
    isolation = run(sandbox, ADD).isolation
    assert isolation["network"] in ("namespace", "audit")
    assert isolation["pid"] in ("namespace", "group")
    assert isolation["user"] == ("separate" if os.geteuid() == 0 else "same")


# -- the pool -------------------------------------------------------------------------------------

@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_the_pool_runs_jobs_off_the_loop_and_at_most_concurrency_at_once():
    sandbox = Sandbox(FAST, concurrency=2)
    ticks = []

    async def main():
        async def ticker():
            while len(ticks) < 10_000:
                ticks.append(time.monotonic())
                await anyio.sleep(0.01)

        results = [None] * 6
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)

            async def one(i):
                results[i] = await sandbox.run("import time\ntime.sleep(0.3)\n" + ADD, TESTS)

            async with anyio.create_task_group() as jobs:
                for i in range(6):
                    jobs.start_soon(one, i)
            tg.cancel_scope.cancel()
        return results

    started = time.monotonic()
    results = anyio.run(main)
    elapsed = time.monotonic() - started
    assert [r.passed for r in results] == [4] * 6
    assert elapsed >= 0.9  # 6 jobs of 0.3 s, 2 at a time
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert len(ticks) > 50 and max(gaps) < 0.5  # the loop kept ticking


def test_limits_and_arguments_are_checked():
    with pytest.raises(ValueError, match="wall_seconds must be > 0"):
        Limits(wall_seconds=0)
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        Sandbox(concurrency=-1)
    with pytest.raises(TypeError, match="strings of Python source"):
        anyio.run(lambda: Sandbox().run(ADD, [1]))
    with pytest.raises(TypeError, match=r"unknown sampling option\(s\) \['temp'\]"):
        Code(TASKS, sampling={"temp": 0.5})
    assert Code(TASKS).sampling == Code(TASKS, sampling={}).sampling == ab.SamplingParams(
        max_new_tokens=512)
    assert Code(TASKS, sampling={"temperature": 0.5}).sampling.temperature == 0.5


# -- tasks ----------------------------------------------------------------------------------------

def test_mbpp_and_humaneval_rows_become_tasks():
    mbpp = normalize({"text": "Write a function to add two numbers.",
                      "test_list": [*TESTS[:2], "assert True"],
                      "test_setup_code": "import math", "test_imports": ["import re"]})
    assert mbpp["tests"] == TESTS[:2] and mbpp["entry_point"] == "add"  # `assert True` dropped
    assert mbpp["setup"] == "import re\nimport math" and mbpp["count"] == "tests"
    assert "called add" in mbpp["prompt"] and TESTS[0] in mbpp["prompt"]
    row = {"prompt": "def add(a, b):\n    \"\"\"Add.\"\"\"\n", "entry_point": "add",
           "test": "METADATA = {}\n\ndef check(candidate):\n    x = 2\n"
                   "    assert candidate(1, 2) == 3\n    assert True\n"
                   "    for y in range(3):\n        assert candidate(x, y) == x + y\n"}
    humaneval = normalize(row)
    assert humaneval["tests"] == [row["test"] + "\n\ncheck(add)\n"]  # check, whole
    assert humaneval["setup"] == row["prompt"] and humaneval["count"] == "tests"
    assert normalize(row, partial_credit=True)["count"] == "asserts"
    sandbox = Sandbox(FAST, concurrency=1)
    assert run(sandbox, ADD, humaneval["tests"], entry_point="add").fraction == 1.0
    nearly = "def add(a, b):\n    return a + b if a != 2 or b < 2 else 0"
    assert run(sandbox, nearly, humaneval["tests"], entry_point="add").fraction == 0.0
    partial = run(sandbox, nearly, humaneval["tests"], entry_point="add", count="asserts")
    assert (partial.passed, partial.total) == (1, 2)  # the loop's assert failed once: it fails
    with pytest.raises(TaskError, match="needs 'tests'.*HumanEval.*MBPP"):
        normalize({"question": "?"})
    with pytest.raises(TaskError, match="check"):
        normalize({"prompt": "", "entry_point": "f", "test": "assert True"})


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_generated_tasks_are_solved_by_their_own_solutions():
    tasks = synthetic_tasks(8, seed=3)
    assert len({t["entry_point"] for t in tasks}) > 2
    sandbox = Sandbox(FAST, concurrency=2)
    for task in tasks[:4]:
        assert run(sandbox, task["solution"], task["tests"]).fraction == 1.0


@pytest.mark.parametrize("reply, program", [
    (f"Here:\n```python\n{ADD}\n```\nDone.", ADD),
    (f"```py\nx = 1\n```\nthen\n```python\n{ADD}\n```", ADD),   # the last block
    (f"<think>```python\nbad\n```</think>{ADD}", ADD),           # a bare def, thinking left out
    ("I cannot do that.", None),
    ("```python\n```", None),
])
def test_extract_code(reply, program):
    assert extract_code(reply) == program


def test_read_prediction():
    assert read_prediction("looks fine \\boxed{pass}") is True
    assert read_prediction("\\boxed{pass} hmm no \\boxed{FAIL}") is False
    assert read_prediction("<think>\\boxed{pass}</think>unsure") is None


# -- episodes -------------------------------------------------------------------------------------

TASKS = [{"prompt": "Write add(a, b).", "tests": TESTS, "entry_point": "add"},
         {"prompt": "Write add again.", "tests": TESTS, "entry_point": "add"}]


@pytest.mark.parametrize("reply, reward, counts", [
    (f"```python\n{ADD}\n```", 1.0, {}),
    ("```python\ndef add(a, b):\n    return 3\n```", 0.25, {}),
    ("no code here", 0.0, {"no_code": 1}),
    ("```python\nimport os\nos.kill(os.getppid(), 9)\n```", 0.0, {"sandbox_error": 1}),
])
def test_code_episodes(sandbox, reply, reward, counts):
    env = Code(TASKS, sandbox=sandbox)
    trajectory = play(env, TASKS[0], coder=scripted("c", reply))
    assert trajectory.rewards == {"coder": reward}
    assert dict(trajectory.counts) == {"retokenized": 0, **counts}
    assert trajectory.error is None
    if "```" in reply:
        (call,) = trajectory.tool_calls
        assert call.name == "run_tests" and call.result["fraction"] == reward


def test_the_verifier_is_rewarded_for_predicting_the_tests(sandbox):
    env = CodeVerifier(TASKS, sandbox=sandbox)
    right = f"```python\n{ADD}\n```"
    for coder, verdict, rewards in [
        (right, "\\boxed{pass}", {"coder": 1.0, "verifier": 1.0}),
        (right, "\\boxed{fail}", {"coder": 1.0, "verifier": 0.0}),
        ("```python\ndef add(a, b):\n    return 0\n```", "\\boxed{fail}",
         {"coder": 0.25, "verifier": 1.0}),
        ("nothing", "hmm", {"coder": 0.0, "verifier": 0.0}),
    ]:
        verifier = scripted("v", verdict)
        trajectory = play(env, TASKS[0], coder=scripted("c", coder), verifier=verifier)
        assert trajectory.rewards == rewards
        assert "Does the program solve the task?" in verifier.engine.prompts[0]


def test_bad_data_is_refused_when_the_environment_is_built():
    with pytest.raises(TaskError, match="needs 'tests'"):
        Code([{"question": "no tests"}])


def test_both_environments_load_by_name():
    assert isinstance(ab.environments.load("code", data=TASKS), Code)
    assert ab.environments.load("code_verifier", data=TASKS).roles == ("coder", "verifier")


def test_a_judge_that_cannot_start_leaves_no_pipe_open(monkeypatch):
    """The program's two pipe ends are closed also when the judge process cannot be started
    (no memory, too many processes): a pool that retries would otherwise run out of files."""
    from astranb_code import _contain, harness

    class NoJob:
        def launch(self, *args, **kwargs):
            raise AssertionError("no job starts without its judge")

    def refuse(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(_contain, "popen", refuse)
    before = sorted(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(OSError, match="temporarily unavailable"):
            harness.run_tests(NoJob(), ADD, ["assert add(1, 2) == 3"], setup="",
                              entry_point="add", count="tests", limits=Limits())
    assert sorted(os.listdir("/proc/self/fd")) == before
