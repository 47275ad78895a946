"""SGLang's wire format for SGLangEngine: /generate bodies in, answers and /metrics text out.

Pure functions over plain dicts and strings (no I/O), so each mapping can be tested on its own.
The request and answer shapes are the ones `astranb.engines.sglang` documents (SGLang 0.5.x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from ..errors import AstranbError
from ..types import GenerationRequest, SamplingParams

__all__ = ["SGLangError"]


class SGLangError(AstranbError, RuntimeError):
    """The SGLang server was unreachable, refused a call, or answered something unexpected."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """HTTP status of a refused call (None when there was no answer)."""


@dataclass(frozen=True)
class _Stretch:
    """One /generate answer: tokens of one uninterrupted stretch of decoding."""

    ids: list[int]
    logprobs: list[float]
    finish: str
    weight_version: Any
    message: str


def _check_request(request: GenerationRequest) -> None:
    if not isinstance(request, GenerationRequest):
        raise TypeError(f"expected a GenerationRequest, got {type(request).__name__}")
    if not request.prompt_ids or not all(isinstance(t, int) and t >= 0 for t in request.prompt_ids):
        raise ValueError(f"prompt_ids must be non-empty token ids, got {request.prompt_ids!r}")


def _body(request: GenerationRequest, done: list[int], rid: str) -> dict:
    """A /generate body that continues `request` after the tokens already generated."""
    s = request.sampling
    sampling = {"temperature": s.temperature, "top_p": s.top_p,
                "max_new_tokens": s.max_new_tokens - len(done),
                "stop_token_ids": list(s.stop_token_ids), "skip_special_tokens": True}
    return {"input_ids": [*request.prompt_ids, *done], "rid": rid, "return_logprob": True,
            "sampling_params": sampling}


def _parse_stretch(answer: dict) -> _Stretch:
    """Tokens, logprobs and finish reason of a /generate answer; names any missing field."""
    meta = answer.get("meta_info")
    if not isinstance(meta, dict) or "finish_reason" not in meta:
        missing = "meta_info.finish_reason" if isinstance(meta, dict) else "meta_info"
        keys = sorted(meta or answer)
        raise SGLangError(f"SGLang /generate answer has no '{missing}' (keys: {keys})")
    reason = meta["finish_reason"]
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length", "abort"):
        raise SGLangError(f"SGLang /generate answer has an unknown meta_info.finish_reason "
                          f"{reason!r}")
    triples = meta.get("output_token_logprobs")
    if triples is None and kind != "abort":  # an aborted answer may come without them
        raise SGLangError("SGLang /generate answer has no 'meta_info.output_token_logprobs' "
                          "although the engine sent return_logprob=true")
    try:
        logprobs = [float(t[0]) for t in triples or ()]
        logprob_ids = [int(t[1]) for t in triples or ()]
        ids = [int(t) for t in answer.get("output_ids", logprob_ids)]  # old servers: triples only
    except (TypeError, ValueError, IndexError) as error:
        raise SGLangError("SGLang /generate answer has malformed output_ids or meta_info.output_"
                          f"token_logprobs (want [logprob, token_id, text]): {error}") from error
    if ids != logprob_ids:
        if kind != "abort":
            raise SGLangError(f"SGLang /generate answer: output_ids ({len(ids)} tokens) and "
                              f"meta_info.output_token_logprobs ({len(logprob_ids)}) disagree")
        n = next((i for i, (a, b) in enumerate(zip(ids, logprob_ids, strict=False)) if a != b),
                 min(len(ids), len(logprob_ids)))
        ids, logprobs = ids[:n], logprobs[:n]
    message = str(reason.get("message") or "") if isinstance(reason, dict) else ""
    return _Stretch(ids, logprobs, kind, meta.get("weight_version"), message)


def _finish(stretch: _Stretch, ids: list[int], sampling: SamplingParams) -> str | None:
    """Why the request is done ("stop" first, as in HFEngine), or None when it must resume."""
    if ids and ids[-1] in sampling.stop_token_ids:
        return "stop"
    if len(ids) >= sampling.max_new_tokens:
        return "length"
    return None if stretch.finish == "abort" else stretch.finish  # "stop": the model's own EOS


def _stretch_version(stretch: _Stretch, sent_version: int, known_versions: set[int]) -> int:
    """The version of a stretch's tokens: the server's weight_version when it is one the engine
    set (right even for a request that reached the server while it was paused), else the version
    when the stretch was sent."""
    try:
        reported = int(stretch.weight_version)
    except (TypeError, ValueError):  # "default" (never updated) or a server without the field
        return sent_version
    return reported if reported in known_versions else sent_version


def _answer(method: str, path: str, response: httpx.Response, as_json: bool):
    """A call's answer: the response itself, or with `as_json` its JSON object body. SGLangError
    (quoting the body) for an HTTP error, or for a body that is not a JSON object."""
    if not response.is_success:
        raise SGLangError(f"SGLang {method} {path} answered HTTP {response.status_code}: "
                          f"{_snippet(response.text)}", status=response.status_code)
    if not as_json:
        return response
    try:
        data = response.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise SGLangError(f"SGLang {method} {path} answered {_snippet(response.text)!r}, "
                          "not a JSON object")
    return data


def _gauge_sum(text: str, name: str) -> float:
    """Sum of a Prometheus gauge over its series (one per scheduler); 0 when absent."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        rest = line[line.rindex("}") + 1:] if "{" in line else line[len(name):]
        try:
            total += float(rest.split()[0])
        except (IndexError, ValueError):
            raise SGLangError(f"SGLang /metrics has a malformed {name} line: {line!r}") from None
    return total


def _snippet(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
