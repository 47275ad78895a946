"""The rollout service's request bodies: validated by FastAPI and published in its OpenAPI
schema (docs/openapi/rollout.json). Names and sizes are bounded so a hostile body is refused
with 422 before anything is built."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

__all__ = ["NAME", "EnvironmentIn", "EpisodeIn", "GenerateIn", "ModelIn", "NotifyIn", "PolicyIn",
           "PullIn", "SamplingIn", "SubmitIn"]

NAME = r"^[A-Za-z0-9_.:-]{1,64}$"


Small = Annotated[int, Field(ge=-1, le=65536)]  # tiny-model config values: model sizes stay sane


class ModelIn(BaseModel):
    name: str = Field(max_length=200)
    path: str | None = Field(default=None, min_length=1, max_length=4096)
    config: dict[str, Small | float | Annotated[str, Field(max_length=200)] | bool | None] = Field(
        default={}, max_length=64)
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    kind: str = Field(default="", pattern=r"^(tiny|tiny_chat|local|hf)?$")
    repo: str | None = Field(default=None, min_length=1, max_length=300)
    revision: str | None = Field(default=None, min_length=1, max_length=200)
    dtype: str | None = Field(default=None, min_length=1, max_length=40)


class PolicyIn(BaseModel):
    name: str = Field(pattern=NAME)
    model: ModelIn
    max_batch_size: int = Field(default=64, ge=1, le=1024)
    seed: int = 0


class EnvironmentIn(BaseModel):
    name: str = Field(pattern=NAME)
    kwargs: dict[str, Any] = {}
    roles: dict[str, str] = Field(min_length=1)


class EpisodeIn(BaseModel):
    id: str = Field(min_length=1, max_length=200)
    env_id: str = Field(min_length=1, max_length=200)
    sample: dict[str, Any]
    group: int = 0
    started_version: int = 0


class SubmitIn(BaseModel):
    items: list[EpisodeIn] = Field(max_length=10_000)
    lane: Literal["train", "eval"] = "train"


class PullIn(BaseModel):
    ack: list[str] = Field(default=[], max_length=1_000_000)
    max: int = Field(default=512, ge=1, le=10_000)
    wait: float = Field(default=0.0, ge=0.0, le=30.0)
    lane: Literal["train", "eval"] = "train"
    resend: bool = False


class NotifyIn(BaseModel):
    policy: str = Field(pattern=NAME)
    version: int = Field(ge=0)
    url: str = Field(pattern=r"^https?://", max_length=2048)
    checksum: int | None = None
    relay: str | None = Field(default=None, pattern=r"^https?://", max_length=2048)
    share: bool = False


class SamplingIn(BaseModel):
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(default=16, ge=1, le=8192)
    stop_token_ids: list[int] = []


class GenerateIn(BaseModel):
    policy: str = Field(pattern=NAME)
    prompt_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1, max_length=65536)
    sampling: SamplingIn = SamplingIn()
