"""`LocalChat`: verifiers' own chat loop (the `null` harness's program), run by this Python.

verifiers 0.4.0 runs every agent as a program in a runtime: the `null` harness's program is a
short chat loop (the task's prompt, then model calls; tool calls go to the task's MCP servers,
their results back to the model, until a reply calls no tool). Its stock launcher installs that
program's dependencies with `uv` on first use (`uv sync --script`), which needs `uv` and the
network. Every one of them (openai, mcp, httpx, httpx2, tenacity, certifi) is a dependency of
verifiers itself, so this harness runs the same program, byte for byte, with the interpreter
astranb runs in: no `uv`, no download, nothing written outside the runtime's work directory but
the program file (in the temp directory, named by its hash).

verifiers finds a harness by module name: `LocalChatConfig(id=HARNESS_ID)` names this one.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from verifiers.v1.harnesses.null import NullHarness, NullHarnessConfig
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

__all__ = ["HARNESS_ID", "LocalChat", "local_chat_config"]

HARNESS_ID = "astranb_verifiers"
"""The harness id verifiers resolves to `LocalChat` (the package exports it)."""


def local_chat_config(**fields: Any) -> NullHarnessConfig:
    """The harness config that runs `LocalChat` (the `null` harness's settings)."""
    return NullHarnessConfig(**{**fields, "id": HARNESS_ID})


def _program_path() -> str:
    """The chat program written once per content (several processes may race: each writes
    its own file and renames it into place)."""
    data = CHAT_PROGRAM_SOURCE.encode()
    digest = hashlib.sha256(data).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"astranb-verifiers-chat-{digest}.py"
    if not path.exists() or path.read_bytes() != data:
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        part.write_bytes(data)
        part.replace(path)
    return str(path)


class _HostPython:
    """The runtime the program is launched into, with its uv step answered by this Python."""

    def __init__(self, runtime: Any):
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script: str | bytes, env: Any = None, *,
                                activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        if data != CHAT_PROGRAM_SOURCE.encode():
            raise RuntimeError("LocalChat runs verifiers' chat program only")
        return [sys.executable, _program_path()]


class LocalChat(NullHarness):
    """verifiers' `null` harness (its tool-using chat loop) run with this interpreter; local
    (subprocess) runtimes only."""

    async def setup(self, runtime: Any) -> None:
        self._require_local(runtime)

    async def launch(self, ctx: Any, trace: Any, runtime: Any, *args: Any, **kwargs: Any
                     ) -> Any:
        self._require_local(runtime)
        return await super().launch(ctx, trace, _HostPython(runtime), *args, **kwargs)

    @staticmethod
    def _require_local(runtime: Any) -> None:
        if getattr(runtime, "type", None) != "subprocess":
            raise RuntimeError(
                f"astranb runs verifiers' chat loop in this process's Python, in a subprocess "
                f"runtime; got a {getattr(runtime, 'type', type(runtime).__name__)!r} runtime. "
                "Leave the agent's runtime unset (astranb sets SubprocessConfig())")
