"""A stand-in for an SGLang server's native HTTP API, for CPU tests (no GPU, no sglang package).

Requests and answers have the shapes `astranb.engines.sglang` documents (SGLang 0.5.x). Tokens are
a deterministic function of the context and of how many times weights were loaded, so a test can
predict every token and logprob with `expected()`:

    next token = 3 + (7 * sum(context[-3:]) + len(context) + 11 * loads) % (vocab - 3)
    logprob    = -0.1 * (1 + loads) - 0.01 * (token % 5)

Serve it in-process with `httpx.ASGITransport(app=FakeSGLang().app)`, or as a process with `main()`
(tests put it behind a fake `sglang.launch_server` module).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

VOCAB = 79


def next_token(context: list[int], loads: int, vocab: int = VOCAB) -> int:
    return 3 + (7 * sum(context[-3:]) + len(context) + 11 * loads) % (vocab - 3)


def logprob_of(token: int, loads: int) -> float:
    return -0.1 * (1 + loads) - 0.01 * (token % 5)


def expected(context, n: int, loads: int = 0, stop=()) -> tuple[list[int], list[float]]:
    """The tokens and logprobs the fake generates after `context` (stopping at `stop`)."""
    context, tokens = list(context), []
    while len(tokens) < n:
        tokens.append(next_token(context + tokens, loads))
        if tokens[-1] in stop:
            break
    return tokens, [logprob_of(t, loads) for t in tokens]


class FakeSGLang:
    """The fake server's state; every attribute is there for tests to set or inspect."""

    def __init__(self, *, step_delay: float = 0.0, dp_size: int = 1, metrics: bool = True,
                 weight_version: str = "default", api_key: str | None = None) -> None:
        self.step_delay, self.dp_size = step_delay, dp_size
        self.metrics, self.api_key = metrics, api_key
        self.weight_version = weight_version
        self.queue_reqs = [0] * dp_size  # the sglang:num_queue_reqs gauge, per dp rank
        self.loads = 0  # weight loads so far (changes the tokens)
        self.loaded_checksum: int | None = None  # astranb.weights.checksum of the last load
        self.loaded_files: list[str] = []  # names in the last loaded directory
        self.bodies: list[dict] = []  # every /generate body, in arrival order
        self.running: dict[str, list[int]] = {}  # rid -> tokens generated so far
        self.aborted: list[str] = []  # rids named by /abort_request
        self.pauses = self.continues = self.flushes = 0
        self.updated_while_running = False
        self.fail_next: dict[str, tuple[int, str]] = {}  # path -> (status, text), answered once
        self.answer_next: dict | None = None  # the next /generate answer, as is
        self.on_update: Callable[[], None] | None = None  # called while loading weights
        self._abort: set[str] = set()
        self._resumed = asyncio.Event()
        self._resumed.set()
        routes = {
            "/generate": (["POST"], self.generate),
            "/abort_request": (["POST"], self.abort_request),
            "/pause_generation": (["POST"], self.pause_generation),
            "/continue_generation": (["POST"], self.continue_generation),
            "/update_weights_from_disk": (["POST"], self.update_weights_from_disk),
            "/flush_cache": (["GET", "POST"], self.flush_cache),
            "/metrics": (["GET"], self.metrics_text),
            "/get_model_info": (["GET"], self.model_info),
            "/get_server_info": (["GET"], self.server_info),
            "/health": (["GET"], self.health),
            "/health_generate": (["GET"], self.health),
        }
        self.app = Starlette(routes=[Route(path, self._guard(path, handler), methods=methods)
                                     for path, (methods, handler) in routes.items()])

    def _guard(self, path: str, handler):
        async def endpoint(request: Request) -> Response:
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                return JSONResponse({"error": {"message": "Unauthorized"}}, status_code=401)
            if path in self.fail_next:
                status, text = self.fail_next.pop(path)
                return PlainTextResponse(text, status_code=status)
            return await handler(request)

        return endpoint

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if self.answer_next is not None:
            answer, self.answer_next = self.answer_next, None
            return JSONResponse(answer)
        await self._resumed.wait()  # a paused server holds new requests
        rid, params = body.get("rid") or uuid.uuid4().hex, body["sampling_params"]
        context, tokens, logprobs = list(body["input_ids"]), [], []
        finish = {"type": "length", "length": params["max_new_tokens"]}
        self.running[rid] = tokens
        try:
            while len(tokens) < params["max_new_tokens"]:
                await asyncio.sleep(self.step_delay)
                if rid in self._abort:
                    finish = {"type": "abort", "message": "Abort in running batch."}
                    break
                tokens.append(next_token(context + tokens, self.loads))
                logprobs.append(logprob_of(tokens[-1], self.loads))
                if tokens[-1] in (params.get("stop_token_ids") or ()):
                    finish = {"type": "stop", "matched": tokens[-1]}
                    break
        finally:
            self.running.pop(rid, None)
            self._abort.discard(rid)
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(context),
                "completion_tokens": len(tokens), "cached_tokens": 0,
                "weight_version": self.weight_version}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None]
                                             for lp, t in zip(logprobs, tokens, strict=True)]
        return JSONResponse({"text": "", "output_ids": tokens, "meta_info": meta})

    async def abort_request(self, request: Request) -> Response:
        body = await request.json()
        rids = list(self.running) if body.get("abort_all") else [body.get("rid", "")]
        self.aborted += rids
        self._abort.update(r for r in rids if r in self.running)
        return Response(status_code=200)

    async def pause_generation(self, request: Request) -> Response:
        body = await request.json()
        self.pauses += 1
        self._resumed.clear()
        if body.get("mode", "abort") == "abort":  # abort running requests, wait until they answered
            self._abort.update(self.running)
            while self.running:
                await asyncio.sleep(0.001)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: Request) -> Response:
        self.continues += 1
        self._resumed.set()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: Request) -> Response:
        from safetensors.torch import load_file

        from astranb.weights import checksum

        body = await request.json()
        self.updated_while_running |= bool(self.running)
        if self.on_update is not None:
            self.on_update()
        directory = Path(body["model_path"])
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            return JSONResponse({"success": False, "message": f"no *.safetensors in {directory}",
                                 "num_paused_requests": 0}, status_code=400)
        tensors = {name: t for f in files for name, t in load_file(str(f)).items()}
        self.loaded_checksum, self.loads = checksum(tensors), self.loads + 1
        self.loaded_files = sorted(p.name for p in directory.iterdir())
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return JSONResponse({"success": True, "message": "Succeeded to update model weights.",
                             "num_paused_requests": 0})

    async def flush_cache(self, request: Request) -> Response:
        self.flushes += 1
        status = 400 if self.running else 200
        return PlainTextResponse("Cache flushed.\n", status_code=status)

    async def metrics_text(self, request: Request) -> Response:
        if not self.metrics:
            return PlainTextResponse("Not Found", status_code=404)
        lines = []
        running = [len(self.running)] + [0] * (self.dp_size - 1)
        for name, values in (("sglang:num_queue_reqs", self.queue_reqs),
                             ("sglang:num_running_reqs", running)):
            lines += [f"# HELP {name} fake", f"# TYPE {name} gauge"]
            lines += [f'{name}{{engine_type="unified",model_name="fake model",pp_rank="0",'
                      f'tp_rank="0",dp_rank="{rank}"}} {float(v)}' for rank, v in enumerate(values)]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def model_info(self, request: Request) -> Response:
        return JSONResponse({"model_path": "fake", "tokenizer_path": "fake",
                             "is_generation": True, "preferred_sampling_params": None,
                             "weight_version": self.weight_version})

    async def server_info(self, request: Request) -> Response:
        return JSONResponse({"model_path": "fake", "dp_size": self.dp_size, "tp_size": 1,
                             "weight_version": self.weight_version, "internal_states": [{}],
                             "version": "0.5-fake"})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)


def main(argv: list[str] | None = None) -> None:
    """Serve the fake like `python -m sglang.launch_server` would (unknown arguments ignored)."""
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--api-key")
    parser.add_argument("--fake-crash", action="store_true")
    args, _ = parser.parse_known_args(argv)
    print(f"fake sglang pid {os.getpid()} argv:", " ".join(sys.argv[1:] if argv is None else argv),
          flush=True)
    if args.fake_crash:
        print("RuntimeError: CUDA out of memory (pretend)", file=sys.stderr, flush=True)
        sys.exit(3)
    fake = FakeSGLang(metrics=args.enable_metrics, weight_version=args.weight_version,
                      api_key=args.api_key)
    uvicorn.run(fake.app, host=args.host, port=args.port, log_level="warning")
