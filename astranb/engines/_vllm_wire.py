"""vLLM's wire format for VLLMEngine: /inference/v1/generate bodies in, answers out.

Pure functions over plain dicts (no I/O), so each mapping can be tested on its own. The shapes are
those of vLLM 0.32's token-in/token-out endpoint (`vllm/entrypoints/scale_out/token_in_token_out/
protocol.py`): a body {request_id, token_ids, sampling_params} answers {choices: [{token_ids,
finish_reason: "stop"|"length"|"abort", logprobs: {content: [{token_id, logprob}, ...]},
weight_versions: [{version, start, end}, ...]}]}.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from ..errors import AstranbError
from ..types import GenerationRequest, SamplingParams

__all__ = ["VLLMError"]


class VLLMError(AstranbError, RuntimeError):
    """The vLLM server was unreachable, refused a call, or answered something unexpected."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """HTTP status of a refused call (None when there was no answer)."""


@dataclass(frozen=True)
class _Stretch:
    """One /inference/v1/generate answer: the tokens of one uninterrupted stretch of decoding."""

    ids: list[int]
    logprobs: list[float]
    finish: str
    labels: list[str | None]
    """The server's weight-version label of each token (None where it gave none)."""


def _body(request: GenerationRequest, done: list[int], rid: str) -> dict:
    """A generate body that continues `request` after the tokens already generated.

    ignore_eos: the completion ends at the request's stop_token_ids or its length only, as in
    HFEngine (a stop id that is the model's EOS still ends it)."""
    s = request.sampling
    sampling = {"temperature": s.temperature, "top_p": s.top_p,
                "max_tokens": s.max_new_tokens - len(done),
                "stop_token_ids": list(s.stop_token_ids), "ignore_eos": True, "logprobs": 0,
                "detokenize": False}
    return {"request_id": rid, "token_ids": [*request.prompt_ids, *done],
            "sampling_params": sampling}


def _parse_stretch(answer: dict) -> _Stretch:
    """Tokens, logprobs, finish reason and version labels of a generate answer; names any
    missing or malformed field."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise VLLMError(f"vLLM generate answer has no single choice (keys: {sorted(answer)})")
    choice = choices[0]
    kind = choice.get("finish_reason")
    if kind not in ("stop", "length", "abort"):
        raise VLLMError(f"vLLM generate answer has an unknown finish_reason {kind!r}")
    try:
        ids = [int(t) for t in choice.get("token_ids") or ()]
        content = (choice.get("logprobs") or {}).get("content") or ()
        logprobs = [float(c["logprob"]) for c in content]
        logprob_ids = [int(c["token_id"]) for c in content]
        labels = _labels(choice.get("weight_versions"), len(ids))
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        raise VLLMError("vLLM generate answer has malformed token_ids, logprobs or "
                        f"weight_versions: {error!r}") from error
    if ids != logprob_ids:
        raise VLLMError(f"vLLM generate answer: token_ids ({len(ids)} tokens) and "
                        f"logprobs.content ({len(logprob_ids)}) disagree; the engine sent "
                        "logprobs=0, so the server should return one logprob per token")
    return _Stretch(ids, logprobs, kind, labels)


def _labels(spans, n: int) -> list[str | None]:
    """Per-token weight-version labels from vLLM's spans [{version, start, end}] over n tokens."""
    labels: list[str | None] = [None] * n
    for span in spans or ():
        for i in range(max(0, int(span["start"])), min(n, int(span["end"]))):
            labels[i] = str(span["version"])
    return labels


def _versions(stretch: _Stretch, sent_version: int, known_versions: set[int]) -> list[int]:
    """Each token's version: the server's label when it is a version this engine set (right even
    for a request that reached the server while it was paused for an update), else the version
    when the stretch was sent."""
    out = []
    for label in stretch.labels:
        try:
            reported = int(label) if label is not None else None
        except ValueError:  # "default": a server whose version was never set
            reported = None
        out.append(reported if reported in known_versions else sent_version)
    return out


def _finish(stretch: _Stretch, ids: list[int], sampling: SamplingParams) -> str | None:
    """Why the request is done ("stop" first, as in HFEngine), or None when it must resume."""
    if ids and ids[-1] in sampling.stop_token_ids:
        return "stop"
    if len(ids) >= sampling.max_new_tokens:
        return "length"
    return None if stretch.finish == "abort" else stretch.finish


def _answer(method: str, path: str, response: httpx.Response, as_json: bool):
    """A call's answer: the response itself, or with `as_json` its JSON object body. VLLMError
    (quoting the body) for an HTTP error, or for a body that is not a JSON object."""
    if not response.is_success:
        hint = (" (start the server with --enable-scale-out and VLLM_SERVER_DEV_MODE=1: "
                "VLLMEngine uses its token-in/token-out and weight-reload endpoints)"
                if response.status_code in (403, 404) else "")
        raise VLLMError(f"vLLM {method} {path} answered HTTP {response.status_code}: "
                        f"{_snippet(response.text)}{hint}", status=response.status_code)
    if not as_json:
        return response
    try:
        data = response.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise VLLMError(f"vLLM {method} {path} answered {_snippet(response.text)!r}, "
                        "not a JSON object")
    return data


def _snippet(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
