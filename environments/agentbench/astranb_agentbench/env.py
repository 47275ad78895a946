"""`AgentBench`: one AgentBench sample per episode, played turn by turn over the controller."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import anyio

from astranb import Environment, SamplingParams

__all__ = ["AgentBench", "AgentBenchError", "default_reward"]

RUNNING = "running"
_ROLES = {"user": "user", "agent": "assistant", "system": "system"}


class AgentBenchError(RuntimeError):
    """The controller could not be reached, or answered with an error."""


def default_reward(status: str, result: Any) -> float:
    """A finished sample's reward: result["reward"] when it is a number (WebShop), else
    result["result"] as a number or a bool (ALFWorld, OS: 1 for success), else 0. Any status
    but "completed" scores 0 unless the result says otherwise."""
    if isinstance(result, Mapping):
        for key in ("reward", "result", "score"):
            value = result.get(key)
            if isinstance(value, bool):
                return float(value)
            if isinstance(value, (int, float)):
                return float(value)
    if isinstance(result, bool):
        return float(result)
    if isinstance(result, (int, float)):
        return float(result)
    return 0.0


class AgentBench(Environment):
    """Samples of one AgentBench task, played through its controller (see the package docstring).

    Each episode starts a sample, then alternates: the model (role "agent") answers the
    conversation the task server sent, the server answers with the next observation, until the
    sample ends. The reward is `reward(status, result)` of the final output
    (`default_reward`). Counted on the episode: the final status when it is not "completed"
    (`status/agent_invalid_action`, `status/task_limit_reached`, ...), `out_of_turns` (the
    adapter's own cap; the sample is cancelled), `task_server_error` (the controller failed: the
    episode ends with 0, the reason on its "interact" or "start_sample" tool call). A sample
    whose episode ends early (truncated, cancelled, failed) is cancelled on the server.

    The model's conversation keeps what the server sent when it sent it: a task that later
    rewrites earlier history (ALFWorld shortens its action lists) changes only what follows.

    Args:
        task: the task's name in the controller's configuration ("alfworld-std",
            "webshop-std", "os-std", ...).
        controller: the controller's API root.
        indices: the sample indices to play (default: all, read from the controller at the
            first episode).
        test_indices: indices held out as split "test" (for evaluation).
        max_turns: most model turns per sample.
        reward: (status, result) -> float.
        timeout: seconds per HTTP call (starting an ALFWorld sample can take a while).
        sampling: SamplingParams or a dict of its fields (default max_new_tokens=256).
        transport: an httpx transport (tests reach an in-process fake with it).
    """

    roles = ("agent",)

    def __init__(self, task: str, *, controller: str = "http://127.0.0.1:5000/api",
                 indices: Sequence[int | str] | None = None,
                 test_indices: Sequence[int | str] = (), max_turns: int = 50,
                 reward: Callable[[str, Any], float] = default_reward, timeout: float = 300.0,
                 sampling: SamplingParams | Mapping[str, Any] | None = None,
                 max_episode_tokens: int | None = None, transport: Any = None):
        import httpx

        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.task, self.controller = task, controller.rstrip("/")
        self.indices = list(indices) if indices is not None else None
        self.test_indices = list(test_indices)
        self.splits = ("train", "test") if self.test_indices else ("train",)
        self.max_turns, self.reward = max_turns, reward
        self.sampling = SamplingParams.of(sampling, max_new_tokens=256)
        self.max_episode_tokens = max_episode_tokens
        self._httpx = httpx
        self._client = httpx.AsyncClient(timeout=timeout, transport=transport)

    @property
    def name(self) -> str:
        return f"AgentBench[{self.task}]"

    # -- samples ----------------------------------------------------------------------------------
    def samples(self, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        return self.split_samples("train", seed)

    def split_samples(self, split: str, seed: int = 0) -> Iterator[Mapping[str, Any]]:
        """Train: the indices (less the test ones) in a seeded order, reshuffled each epoch.
        Test: the test indices in order. The train indices are read from the controller on
        first use when none were given."""
        if split == "test":
            yield from ({"index": i} for i in self.test_indices)
            return
        rng, epoch = random.Random(seed), 0
        while True:
            if self.indices is None:
                yield {"index": None}  # the episode asks the controller, then plays index 0
                continue
            held = set(map(str, self.test_indices))
            order = [i for i in self.indices if str(i) not in held]
            if not order:
                raise ValueError(f"no training indices for {self.task}: all are test_indices")
            rng.shuffle(order)
            for index in order:
                yield {"index": index, "_epoch": epoch}
            epoch += 1

    # -- one sample -------------------------------------------------------------------------------
    async def episode(self, ctx: Any, sample: Mapping[str, Any]) -> float:
        index = sample.get("index")
        if index is None:
            try:
                self.indices = await ctx.tool("get_indices", self._get_indices)
            except AgentBenchError:
                ctx.count("task_server_error")
                return 0.0
            index = self.indices[0]
        try:
            answer = await ctx.tool("start_sample", self._post, "/start_sample",
                                    {"name": self.task, "index": index})
        except AgentBenchError:
            ctx.count("task_server_error")
            return 0.0
        session_id = answer["session_id"]
        finished = False
        try:
            output = answer["output"]
            history = list(output.get("history") or [])
            messages = [_message(item) for item in history]
            for _ in range(self.max_turns):
                if output["status"] != RUNNING:
                    finished = True
                    break
                reply = await ctx.chat("agent", messages)
                try:
                    answer = await ctx.tool("interact", self._post, "/interact", {
                        "session_id": session_id,
                        "agent_response": {"status": "normal", "content": reply.content}})
                except AgentBenchError:
                    ctx.count("task_server_error")
                    return 0.0
                output = answer["output"]
                history = list(output.get("history") or [])
                sent = len(messages)  # the server's history holds ours, then what is new
                messages.extend(_message(item) for item in history[sent:])
            else:
                if output["status"] != RUNNING:
                    finished = True
            if not finished:
                ctx.count("out_of_turns")
                return 0.0
            status = str(output["status"])
            if status != "completed":
                ctx.count("status/" + status.replace(" ", "_"))
            return float(self.reward(status, output.get("result")))
        finally:
            if not finished:
                await self._cancel(session_id)

    # -- the controller ---------------------------------------------------------------------------
    async def _get_indices(self) -> list[Any]:
        response = await self._request("GET", "/get_indices", params={"name": self.task})
        indices = response.json()
        if not indices:
            raise AgentBenchError(f"the controller has no samples for {self.task!r}")
        return list(indices)

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self._request("POST", path, json=body)
        try:
            answer = response.json()
            answer["output"]["status"]  # noqa: B018 - the shape this adapter relies on
            return answer
        except (ValueError, KeyError, TypeError):
            raise AgentBenchError(f"{path} answered something that is not AgentBench's "
                                  f"output: {response.text[:300]}") from None

    async def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One call to the controller; AgentBenchError when it does not answer or fails."""
        try:
            response = await self._client.request(method, self.controller + path, **kwargs)
        except self._httpx.HTTPError as error:
            raise AgentBenchError(f"the AgentBench controller at {self.controller} did not "
                                  f"answer {path}: {type(error).__name__}: {error}") from None
        if response.status_code != 200:
            raise AgentBenchError(f"{path} for {self.task!r} failed ({response.status_code}): "
                                  f"{response.text[:300]}")
        return response

    async def _cancel(self, session_id: Any) -> None:
        """Cancel the sample on the server, even while this episode is being cancelled (the
        call is shielded, and given 5 s)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            try:
                await self._client.post(self.controller + "/cancel",
                                        json={"session_id": session_id})
            except self._httpx.HTTPError:
                pass  # the controller expires abandoned sessions itself


def _message(item: Mapping[str, Any]) -> dict[str, str]:
    role = _ROLES.get(str(item.get("role")), "user")
    return {"role": role, "content": str(item.get("content") or "")}
