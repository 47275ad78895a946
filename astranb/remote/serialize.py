"""What crosses the wire between a Session and its services, and how it is encoded.

Bodies are JSON or msgpack dicts of plain values (never pickle); tensors travel as safetensors
bytes. This module turns astranb's dataclasses into such dicts and back, and picks the body
encoding from the Content-Type / Accept headers:

    application/json      the default; what curl, browsers and the OpenAPI docs speak
    application/msgpack   what astranb's own client sends (smaller, faster, bytes without base64)

A batch for the trainer is one safetensors blob: its tensors plus a string metadata entry.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import msgpack
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..models import ModelSpec, tiny_parameters
from ..types import Batch, Generation, SamplingParams, ToolCall, Trajectory, Turn

__all__ = [
    "JSON", "MSGPACK", "OCTETS",
    "pack", "unpack",
    "trajectory_to_wire", "trajectory_from_wire",
    "generation_to_wire", "generation_from_wire",
    "sampling_from_wire", "spec_to_wire", "spec_from_wire",
    "batch_to_bytes", "batch_from_bytes",
]

JSON = "application/json"
MSGPACK = "application/msgpack"
OCTETS = "application/octet-stream"


def pack(data: Any, content_type: str = MSGPACK) -> bytes:
    """Encode a dict of plain values as msgpack or JSON."""
    if content_type == MSGPACK:
        return msgpack.packb(data, use_bin_type=True)
    return json.dumps(data, separators=(",", ":")).encode()


def unpack(body: bytes | bytearray, content_type: str | None) -> Any:
    """Decode a body sent as msgpack or JSON (ValueError with the reason if it is neither)."""
    kind = (content_type or JSON).split(";")[0].strip().lower()
    try:
        if kind in (MSGPACK, "application/x-msgpack"):
            return msgpack.unpackb(body, raw=False, strict_map_key=False)
        if kind == JSON or kind.endswith("+json"):
            return json.loads(body) if body else None
    except (ValueError, msgpack.UnpackException) as error:
        raise ValueError(f"body is not valid {kind}: {error}") from None
    raise ValueError(f"unsupported content type {kind!r}; send {JSON} or {MSGPACK}")


# -- episodes -------------------------------------------------------------------------------------

def generation_to_wire(g: Generation) -> dict[str, Any]:
    return {
        "prompt_ids": list(g.prompt_ids), "completion_ids": list(g.completion_ids),
        "logprobs": list(g.logprobs), "versions": list(g.versions),
        "finish_reason": g.finish_reason, "text": g.text,
    }


def generation_from_wire(d: Mapping[str, Any]) -> Generation:
    return Generation(
        tuple(d["prompt_ids"]), tuple(d["completion_ids"]), tuple(float(x) for x in d["logprobs"]),
        tuple(d["versions"]), d["finish_reason"], d.get("text", ""),
    )


def sampling_from_wire(d: Mapping[str, Any]) -> SamplingParams:
    d = dict(d)
    if "stop_token_ids" in d:
        d["stop_token_ids"] = tuple(d["stop_token_ids"])
    return SamplingParams(**d)


def trajectory_to_wire(t: Trajectory) -> dict[str, Any]:
    return {
        "id": t.id, "group": t.group, "sample": dict(t.sample), "rewards": dict(t.rewards),
        "error": t.error, "started_version": t.started_version,
        "turns": [
            {"role": turn.role, "policy": turn.policy,
             "sampling": (dataclasses.asdict(turn.sampling)
                          | {"stop_token_ids": list(turn.sampling.stop_token_ids)}),
             "generation": generation_to_wire(turn.generation)}
            | ({"agent": turn.agent} if turn.agent else {})
            for turn in t.turns
        ],
        "tool_calls": [dataclasses.asdict(call) for call in t.tool_calls],
        "env": t.env, "truncated": t.truncated, "counts": dict(t.counts),
    }


def trajectory_from_wire(d: Mapping[str, Any]) -> Trajectory:
    turns = tuple(
        Turn(t["role"], t["policy"], generation_from_wire(t["generation"]),
             sampling_from_wire(t["sampling"]), str(t.get("agent", "")))
        for t in d["turns"]
    )
    tool_calls = tuple(
        ToolCall(str(c["name"]), dict(c.get("args") or {}), c.get("result"), c.get("error"),
                 int(c.get("position", 0)))
        for c in d.get("tool_calls") or ()
    )
    return Trajectory(
        d["sample"], turns, {k: float(v) for k, v in d["rewards"].items()}, int(d["group"]),
        d.get("error"), int(d.get("started_version", 0)), d.get("id", ""), tool_calls,
        str(d.get("env", "")), d.get("truncated"),
        {str(k): int(v) for k, v in (d.get("counts") or {}).items()},
    )


# -- models ---------------------------------------------------------------------------------------

def spec_to_wire(spec: ModelSpec) -> dict[str, Any]:
    """A ModelSpec as plain values (every kind: tiny, tiny_chat, local, hf)."""
    return dataclasses.asdict(spec)


MAX_TINY_PARAMETERS = 2_000_000_000


def spec_from_wire(d: Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from its wire form; ValueError naming what is wrong.

    A body without "kind" (from an older client) is a local directory when it has a path and a
    tiny model otherwise. A tiny or tiny_chat spec over 2B parameters is refused (a service must
    not be talked into allocating more than its host holds).
    """
    try:
        spec = ModelSpec(
            name=str(d["name"]), path=_optional_str(d, "path"),
            config=dict(d.get("config") or {}), seed=int(d.get("seed", 0)),
            kind=str(d.get("kind") or ""), repo=_optional_str(d, "repo"),
            revision=_optional_str(d, "revision"), dtype=_optional_str(d, "dtype"),
        )
    except KeyError as error:
        raise ValueError(f"model spec lacks {error}; send at least a name") from None
    if spec.kind in ("tiny", "tiny_chat"):
        try:
            size = tiny_parameters(spec.config, spec.kind)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"tiny model config {spec.config} is not usable: {error!r}") from None
        if size > MAX_TINY_PARAMETERS:
            raise ValueError(f"a tiny model of {size:,} parameters is more than this service "
                             f"builds ({MAX_TINY_PARAMETERS:,}); use a local model directory "
                             "instead")
    return spec


def _optional_str(d: Mapping[str, Any], key: str) -> str | None:
    value = d.get(key)
    if value is not None and not isinstance(value, str):
        raise ValueError(f"model spec field {key!r} must be a string or null, got {value!r}")
    return value


# -- batches --------------------------------------------------------------------------------------

BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(Batch))
"""The tensors of a batch on the wire, by name (safetensors keys)."""
_OPTIONAL = ("top_p_B",)  # added later: a client that does not send it sampled with top_p 1


def batch_to_bytes(batch: Batch, **metadata: str) -> bytes:
    """A Batch as one safetensors blob (plus string metadata such as the policy name)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in BATCH_FIELDS:
        tensor = getattr(batch, name).detach().cpu().contiguous()
        if tensor.untyped_storage().data_ptr() in seen:  # safetensors refuses shared storage
            tensor = tensor.clone()
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return st_save(tensors, metadata={k: str(v) for k, v in metadata.items()})


def batch_from_bytes(blob: bytes) -> Batch:
    """Inverse of batch_to_bytes; ValueError naming what is missing or malformed."""
    try:
        tensors = st_load(blob)
    except Exception as error:  # safetensors raises its own error types
        raise ValueError(f"batch is not a valid safetensors blob: {error}") from None
    missing = [n for n in BATCH_FIELDS if n not in tensors and n not in _OPTIONAL]
    if missing:
        raise ValueError(f"batch lacks tensor(s) {missing}; expected {list(BATCH_FIELDS)}")
    present = [n for n in BATCH_FIELDS if n in tensors]
    batch = Batch(**{n: tensors[n] for n in present})
    rows = {n: int(tensors[n].shape[0]) if tensors[n].dim() else -1 for n in present}
    if len(set(rows.values())) != 1:
        raise ValueError(f"batch tensors disagree on the number of rows: {rows}")
    shape = tuple(batch.input_ids_B_T.shape)
    for name in ("attention_mask_B_T", "loss_mask_B_T", "old_logp_B_T", "advantages_B_T",
                 "versions_B_T"):
        if tuple(getattr(batch, name).shape) != shape:
            raise ValueError(f"batch tensor {name} has shape {tuple(getattr(batch, name).shape)}, "
                             f"input_ids_B_T has {shape}")
    if batch.input_ids_B_T.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids_B_T must be integer, got {batch.input_ids_B_T.dtype}")
    return batch
