"""A local SGLang server for SGLangEngine: launch `sglang.launch_server`, wait until it answers
/health, read the end of its log, and stop it with its child processes; and the directories an
SGLang server loads (the model's, and the copy whose weights file each update rewrites).

The server runs in a session and process group of its own (SGLang runs its scheduler and
detokenizer as child processes), so stopping it ends the whole group and Ctrl-C or the kernel's
stop button does not reach it; it is started through astranb/lifeline.py, which ends the group when
the process that launched it is gone. Its output goes to a log file whose last lines
are quoted when it fails to come up.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from .. import lifeline, weights
from ..models import ModelSpec
from ._sglang_wire import SGLangError

WEIGHTS_FILE = "model.safetensors"
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".index.json")


def _require_sglang() -> None:
    """Raise SGLangError saying how to install SGLang when this Python lacks it."""
    if importlib.util.find_spec("sglang") is None:
        raise SGLangError("SGLang is not installed in this Python; on a GPU host run pip "
                          "install 'astranb[sglang]', or pass url= to attach to a running server")


def _launch(model_dir: Path, port: int, server_args: Sequence[str], token: str | None,
            version: int, log_path: Path) -> subprocess.Popen:
    """Start `python -m sglang.launch_server` on 127.0.0.1:`port`, its output in `log_path`.

    Metrics are on (they drive availability), the weight version is `version` unless
    `server_args` sets one, and a token becomes --api-key.
    """
    # through astranb/lifeline.py: the server ends when this process does, however that ends
    command = [sys.executable, lifeline.__file__,
               sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--enable-metrics", *server_args]
    if "--weight-version" not in server_args:
        command += ["--weight-version", str(version)]
    if token:
        command += ["--api-key", token]
    with open(log_path, "wb") as log:  # own session: no Ctrl-C; ended as a whole
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                **lifeline.shielded())


async def _wait_healthy(client: httpx.AsyncClient, process: subprocess.Popen, timeout: float,
                        log_path: Path) -> None:
    """Poll /health until it answers 200; SGLangError with the log's end if the process exits
    first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while (code := process.poll()) is None:
        try:
            if (await client.get("/health", timeout=10.0)).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise SGLangError(f"the SGLang server did not answer /health within {timeout:.0f}s "
                              f"(raise launch_timeout for big models); its last log lines:\n"
                              f"{_log_tail(log_path)}")
        await asyncio.sleep(0.5)
    raise SGLangError(f"the SGLang server exited with code {code} before it was ready; "
                      f"its last log lines:\n{_log_tail(log_path)}")


def _stop_process(process: subprocess.Popen) -> None:
    """End a launched server's process group: SIGTERM, and after 30 s SIGKILL to what is left
    (SGLang runs its scheduler and detokenizer as child processes)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:  # nobody left in the group
            break
        try:
            process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    process.wait()


def _log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a server log ("" when there is none)."""
    text = path.read_text(errors="replace") if path.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- the directories a server loads ----------------------------------------------------------------


def _model_dir(spec: ModelSpec, fallback: Path) -> Path:
    """The spec's model directory; a tiny spec (no path) is saved into `fallback` once."""
    if spec.path is not None:
        return Path(spec.path)
    if not (fallback / "config.json").is_file():
        spec.save(fallback)
    return fallback


def _copy_without_weights(model_dir: Path, directory: Path) -> None:
    """Make `directory` a copy of the model directory's files (config, tokenizer), weights aside."""
    directory.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_FILES):
            shutil.copy2(item, directory / item.name)


def _save_weights(tensors: dict, directory: Path) -> None:
    """Write `tensors` as the directory's weights file: written aside, then renamed, so a server
    loading it never reads half a file."""
    from safetensors.torch import save_file

    save_file(tensors, str(directory / f"{WEIGHTS_FILE}.tmp"), metadata={"format": "pt"})
    os.replace(directory / f"{WEIGHTS_FILE}.tmp", directory / WEIGHTS_FILE)


def _read_checksum(path: Path) -> int:
    """astranb.weights.checksum of a written weights file (LookupError when there is none)."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise LookupError("no published weights were written for this engine")
    return weights.checksum(load_file(str(path)))
