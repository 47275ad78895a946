"""A stand-in AgentBench controller, for tests and for trying the adapter without docker.

It follows the HTTP protocol of THUDM/AgentBench's task controller (get_indices, start_sample,
interact, cancel) and serves one small task, "guess-std": the server thinks of a number from 1
to 10 and answers each "ACTION: n" with higher or lower; 5 guesses at most. A player that halves
the range each time always wins; one that guesses at random wins about 4 times in 10.
`demonstrations` writes conversations of such players, for a warm start.

    fake = FakeController()
    env = AgentBench(TASK, controller="http://fake/api",
                     transport=httpx.ASGITransport(fake.app))
"""

from __future__ import annotations

import random
import re
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

TASK = "guess-std"
INDICES = list(range(10))
MAX_GUESSES = 5


def secret(index: int) -> int:
    return index * 7 % 10 + 1


FIRST = ("Guess my number from 1 to 10. Answer in the form ACTION: n.", "OK.",
         "Your first guess?")


class FakeController:
    """The controller app (`.app`, a Starlette ASGI app) with `samples` sample indices
    (0, 1, ...; index i's number is `secret(i)`)."""

    def __init__(self, samples: int = len(INDICES)) -> None:
        if samples < 1:
            raise ValueError(f"samples must be >= 1, got {samples}")
        self.indices = list(range(samples))
        self.sessions: dict[int, dict] = {}
        self.cancelled: list[int] = []
        self.next_id = 0
        self.app = Starlette(routes=[
            Route("/api/get_indices", self.get_indices, methods=["GET"]),
            Route("/api/start_sample", self.start_sample, methods=["POST"]),
            Route("/api/interact", self.interact, methods=["POST"]),
            Route("/api/cancel", self.cancel, methods=["POST"]),
        ])

    async def get_indices(self, request: Request):
        if request.query_params.get("name") != TASK:
            return PlainTextResponse("Error: Task does not exist", status_code=400)
        return JSONResponse(self.indices)

    async def start_sample(self, request: Request):
        body = await request.json()
        if body.get("name") != TASK:
            return PlainTextResponse("Error: Task does not exist", status_code=406)
        if body.get("index") not in self.indices:
            return PlainTextResponse("Error: Index out of bounds", status_code=400)
        sid, self.next_id = self.next_id, self.next_id + 1
        history = [{"role": role, "content": text}
                   for role, text in zip(("user", "agent", "user"), FIRST, strict=True)]
        self.sessions[sid] = {"index": body["index"], "history": history, "guesses": 0}
        return JSONResponse(self._answer(sid, "running", None))

    async def interact(self, request: Request):
        body = await request.json()
        sid = body["session_id"]
        if sid not in self.sessions:
            return PlainTextResponse("Error: Session does not exist", status_code=400)
        session = self.sessions[sid]
        content = body["agent_response"]["content"]
        session["history"].append({"role": "agent", "content": content})
        match = re.search(r"ACTION:\s*(\d+)", content or "")
        if not match:
            return JSONResponse(self._end(sid, "agent invalid action", {"result": 0}))
        guess, target = int(match.group(1)), secret(session["index"])
        session["guesses"] += 1
        if guess == target:
            return JSONResponse(self._end(sid, "completed",
                                          {"result": 1, "guesses": session["guesses"]}))
        if session["guesses"] >= MAX_GUESSES:
            return JSONResponse(self._end(sid, "task limit reached", {"result": 0}))
        session["history"].append({"role": "user",
                                   "content": "higher" if target > guess else "lower"})
        return JSONResponse(self._answer(sid, "running", None))

    async def cancel(self, request: Request):
        sid = (await request.json())["session_id"]
        self.cancelled.append(sid)
        self.sessions.pop(sid, None)
        return JSONResponse({"session_id": sid, "output": {"status": "cancelled"}})

    def _end(self, sid: int, status: str, result):
        answer = self._answer(sid, status, result)
        del self.sessions[sid]
        return answer

    def _answer(self, sid: int, status: str, result):
        session = self.sessions[sid]
        return {"session_id": sid, "output": {"index": session["index"], "status": status,
                                              "result": result,
                                              "history": list(session["history"])}}


def demonstrations(n: int, seed: int = 0, strategy: str = "random") -> list[dict[str, Any]]:
    """`n` conversations of guess-std as the adapter shows them to the model (the server's
    "agent" turns are the assistant's), for `policy.sft`. strategy "random": guesses drawn at
    random, the feedback ignored (teaches the format only: wins ~4 in 10); "bisect": the middle
    of what the feedback leaves (always wins)."""
    if strategy not in ("random", "bisect"):
        raise ValueError(f"strategy must be 'random' or 'bisect', got {strategy!r}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        target = rng.randint(1, 10)
        messages = [{"role": role, "content": text}
                    for role, text in zip(("user", "assistant", "user"), FIRST, strict=True)]
        low, high = 1, 10
        for _ in range(MAX_GUESSES):
            guess = rng.randint(1, 10) if strategy == "random" else (low + high) // 2
            messages.append({"role": "assistant", "content": f"ACTION: {guess}"})
            if guess == target:
                break
            if target > guess:
                low = guess + 1
            else:
                high = guess - 1
            messages.append({"role": "user", "content": "higher" if target > guess else "lower"})
        else:
            messages.pop()  # the server ends the sample after the last guess: no feedback
        out.append({"messages": messages})
    return out
