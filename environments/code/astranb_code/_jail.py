"""The in-job layers: `python -I -c <this file's source> CONFIG_JSON SCRIPT ARGS...`.

Every job the sandbox launches starts here, in its fresh directory, already in its own session,
under its own uid (when the host runs as root) and, where bubblewrap is installed, inside its
private mount, PID, network and IPC namespaces. Standard library only: this text is passed on the
command line, so the job needs no file of this package. Before any code of the job runs it:

  1. asks to be killed when the process that launched it dies (PR_SET_PDEATHSIG);
  2. lowers its resource limits (CPU seconds, address space, file size, processes, open files,
     no core files);
  3. without bubblewrap, enters new user, network, IPC and PID namespaces when the kernel lets
     an unprivileged process make them (no network interface; every process dies with the job);
  4. installs an audit hook (PEP 578): no socket connect, bind or send, no signal to any process
     but its own children, no file opened for writing outside the job's directory, no new
     program executed, no ctypes (the C library would step around the hook);
  5. writes one JSON line on the status descriptor (its layers) and waits on the go descriptor:
     the host moves the job's processes into their memory group before anything untrusted runs.

Then it runs SCRIPT (a file in the job's directory) as `__main__` with `sys.argv = [SCRIPT,
*ARGS]`.
"""

import ctypes
import json
import os
import resource
import runpy
import signal
import sys

CLONE_NEWUSER, CLONE_NEWNET, CLONE_NEWPID = 0x10000000, 0x40000000, 0x20000000
CLONE_NEWIPC = 0x08000000
PR_SET_PDEATHSIG = 1


def main():
    config = json.loads(sys.argv[1])
    script, args = sys.argv[2], sys.argv[3:]
    here = os.path.realpath(os.getcwd())
    _die_with(config["parent"])
    _limit(config["limits"])
    isolation = {} if config["namespaces"] else _isolate()
    if isolation.get("pid") == "namespace":
        _become_init_of_namespace()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if config["audit"]:
        _guard(here)
    status = os.fdopen(config["status_fd"], "w", encoding="utf-8")
    status.write(json.dumps(isolation) + "\n")
    status.close()
    with os.fdopen(config["go_fd"], "rb") as go:
        if go.read(1) != b"1":
            os._exit(125)  # the host gave up on this job
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def _die_with(parent):
    """Ends this process when its launcher dies; a launcher already gone ends it now."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent and os.getppid() != parent:
        os._exit(125)


def _limit(limits):
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


def _isolate():
    """New user + network + IPC + PID namespaces if the kernel lets an unprivileged process make
    them (no SysV shared memory outlives the job either); otherwise the audit hook and the
    session do the job."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWPID) == 0:
            return {"network": "namespace", "pid": "namespace"}
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWIPC) == 0:
            return {"network": "namespace", "pid": "group"}
    except (OSError, AttributeError):
        pass
    return {"network": "audit", "pid": "group"}


def _become_init_of_namespace():
    """Forks PID 1 of the new namespace (when it dies, so does every process in it); this
    process waits outside and ends as it did."""
    child = os.fork()
    if child == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

        def out_of_cpu(signum, frame):  # PID 1 of a namespace ignores SIGXCPU unless handled
            os._exit(128 + signal.SIGXCPU)

        signal.signal(signal.SIGXCPU, out_of_cpu)
        return
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: be killed by the same one
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    if code == 128 + signal.SIGXCPU:
        signal.signal(signal.SIGXCPU, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGXCPU)
    os._exit(code & 0xFF)


def _guard(here):
    """The audit hook: refuses what a job has no business doing."""
    own = os.getpid()
    writing = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    inside = here.rstrip(os.sep) + os.sep

    def outside(path):
        real = os.path.realpath(os.fsdecode(path))
        return not (real + os.sep).startswith(inside) and real != os.devnull, real

    def refuse_outside(event, *paths):
        for path in paths:
            if isinstance(path, (str, bytes, os.PathLike)):
                out, real = outside(path)
                if out:
                    raise PermissionError(f"the sandbox may write only in its directory "
                                          f"({real}, {event})")

    def hook(event, args):
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
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                    isinstance(flags, int) and flags & writing):
                refuse_outside(event, path)
            elif isinstance(flags, int) and os.path.isdir(path) and outside(path)[0]:
                raise PermissionError(f"the sandbox opens no directory outside its own "
                                      f"({path}, a descriptor to write through)")
        elif event in _PATH_EVENTS:
            paths, dir_fds = _PATH_EVENTS[event]
            refuse_outside(event, *(args[i] for i in paths))
            if any(args[i] not in (-1, None) for i in dir_fds):
                raise PermissionError(f"the sandbox refuses {event} relative to a descriptor")
        elif event in ("os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.system",
                       "ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle",
                       "ctypes.call_function", "ctypes.cdata", "ctypes.cdata/buffer"):
            raise PermissionError(f"the sandbox runs no other programs nor C calls ({event})")

    sys.addaudithook(hook)


_PATH_EVENTS = {  # event: (indices of the paths it changes, indices of its dir_fd arguments)
    "os.link": ((0, 1), (2, 3)), "os.rename": ((0, 1), (2, 3)), "os.mkdir": ((0,), (2,)),
    "os.symlink": ((0, 1), (2,)), "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)),
    "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)),
    "os.truncate": ((0,), ()), "os.mkfifo": ((0,), (2,)), "os.mknod": ((0,), (3,)),
}


def _is_child(pid, parent):
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, ValueError, IndexError):
        return False


main()
