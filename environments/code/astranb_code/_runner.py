"""The sandbox's harness: `python -I _runner.py LIMITS_JSON REPORT_FD`, a copy of this file in the
job's directory.

Runs as a script (standard library only, never this package or astranb) in a fresh process that
`sandbox.Sandbox` started in its own process group, as an unprivileged user when the host runs
as root. Before any untrusted code runs it:

  1. lowers its resource limits (CPU seconds, address space, file size, processes, open files,
     no core files);
  2. enters new user, network and PID namespaces when the kernel allows it: no network
     interface but a downed loopback, and it becomes PID 1 of a namespace whose every process
     dies with it (a fork bomb that calls setsid() still cannot outlive the job);
  3. installs an audit hook, the second layer where namespaces are missing: no socket connect,
     bind or send, no signal to any process but its own children, no file opened for writing
     outside the job's directory, no new program executed.

Then it reads job.json (the program, the setup code, the tests), executes the program and each
test in one namespace, and reports on the descriptor REPORT_FD, one JSON line per event:

    {"event": "ready", "isolation": {"network": "namespace"|"audit", "pid": "namespace"|"group"}}
    {"event": "program", "ok": false, "error": "..."}        the program itself failed
    {"event": "test", "index": i, "ok": true|false, "error": "..."|null}
    {"event": "limit", "error": "..."}                        a limit stopped the job
    {"event": "done"}

The parent counts what arrived: a job killed after its third test keeps the first three.
The program and its tests share one interpreter, as in HumanEval's own harness: containment
protects the host, not the score (a program that attacks the harness can forge its own result).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000


def main() -> None:
    limits = json.loads(sys.argv[1])
    report = os.fdopen(int(sys.argv[2]), "w", buffering=1, encoding="utf-8")
    here = os.path.realpath(os.getcwd())
    _limit(limits)
    isolation = _isolate()
    if isolation["pid"] == "namespace":
        child = os.fork()
        if child:  # outside: wait for the namespace's init, end as it did
            _, status = os.waitpid(child, 0)
            code = os.waitstatus_to_exitcode(status)
            if code < 0:  # killed by a signal: be killed by the same one
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            os._exit(code & 0xFF)

    def out_of_cpu(signum, frame):  # PID 1 of a namespace ignores SIGXCPU unless handled
        _send(report, {"event": "limit", "error": f"over {limits['cpu_seconds']:g} CPU "
                                                  "seconds (SIGXCPU)"})
        os._exit(152)

    signal.signal(signal.SIGXCPU, out_of_cpu)
    _guard(here, isolation)
    _send(report, {"event": "ready", "isolation": isolation})
    with open("job.json", encoding="utf-8") as f:
        job = json.load(f)
    namespace: dict = {"__name__": "__main__"}
    code = "\n".join(part for part in (job.get("setup") or "", job["program"]) if part)
    try:
        exec(compile(code, "program.py", "exec"), namespace)
    except BaseException as error:  # SystemExit and KeyboardInterrupt included
        _send(report, {"event": "program", "ok": False, "error": _describe(error)})
        _send(report, {"event": "done"})
        return
    _send(report, {"event": "program", "ok": True})
    for index, test in enumerate(job["tests"]):
        try:
            exec(compile(test, f"test_{index}.py", "exec"), namespace)
            _send(report, {"event": "test", "index": index, "ok": True, "error": None})
        except BaseException as error:
            _send(report, {"event": "test", "index": index, "ok": False,
                           "error": _describe(error)})
    _send(report, {"event": "done"})


def _limit(limits: dict) -> None:
    cpu = max(1, int(limits["cpu_seconds"] + 0.999))
    wanted = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),
        resource.RLIMIT_AS: (limits["memory_bytes"],) * 2,
        resource.RLIMIT_FSIZE: (limits["file_bytes"],) * 2,
        resource.RLIMIT_NPROC: (limits["processes"],) * 2,
        resource.RLIMIT_NOFILE: (limits["open_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, (soft, hard) in wanted.items():
        _, old_hard = resource.getrlimit(which)
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))


def _isolate() -> dict[str, str]:
    """New user + network + PID namespaces if the kernel lets an unprivileged process make them
    (most Linux distributions do); otherwise the audit hook and the process group do the job."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID) == 0:
            return {"network": "namespace", "pid": "namespace"}
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            return {"network": "namespace", "pid": "group"}
    except (OSError, AttributeError):
        pass
    return {"network": "audit", "pid": "group"}


def _guard(here: str, isolation: dict[str, str]) -> None:
    """The audit hook (PEP 578): refuses what a test program has no business doing."""
    own = os.getpid()
    writing = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    inside = here.rstrip(os.sep) + os.sep

    def hook(event: str, args: tuple) -> None:
        if event in ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"):
            raise PermissionError(f"the sandbox has no network ({event})")
        if event in ("os.kill", "os.killpg"):
            pid = args[0]
            if pid != own and not _is_child(pid, own):
                raise PermissionError(f"the sandbox may signal only its own processes ({pid})")
        elif event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            wants_write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & writing)
            if wants_write:
                real = os.path.realpath(os.fsdecode(path))
                if not (real + os.sep).startswith(inside) and real != os.devnull:
                    raise PermissionError(f"the sandbox may write only in its directory ({real})")
        elif event in ("os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.system"):
            raise PermissionError(f"the sandbox runs no other programs ({event})")

    sys.addaudithook(hook)


def _is_child(pid: int, parent: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, ValueError, IndexError):
        return False


def _describe(error: BaseException) -> str:
    """One line: "SyntaxError: expected ':' (program.py, line 1)", "AssertionError"."""
    text = f"{type(error).__name__}: {error}".rstrip(": ").replace("\n", " ")
    return text[:2000]


def _send(stream, message: dict) -> None:
    try:
        stream.write(json.dumps(message) + "\n")
    except OSError:
        pass


if __name__ == "__main__":
    main()
