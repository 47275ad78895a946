"""A lean forward pass for Llama-family decoders, used by `HFEngine` in place of the model's own.

For a small model on a CPU, most of a transformers forward is Python: mask builders, kwarg
decorators, output dataclasses, a rotary module per call. This module runs the same arithmetic
with plain torch calls on the model's own parameters (so weight updates applied to the model are
seen at once), in the order transformers uses, so logits match the model's forward to the bit
(tests/test_fastlm.py checks it per supported architecture).

Supported: `llama`, `mistral` (no sliding window), `qwen2` (no sliding window), `qwen3`, with the
default rotary embedding, SiLU MLPs and full attention. Anything else (other rope types, biases
on the MLP, a tensor-parallel Llama, an attention other than sdpa/eager, FSDP-wrapped or hooked
modules) gets None from `FastLM.build`, and the caller keeps calling the model.

The engine makes three calls, writing keys/values through a caller's sink; the trainer a fourth,
`logits(ids)`, under autograd, for right-padded batches:

    prefill(ids_K_T, positions_K_T)        right-padded prompts, plain causal attention
        -> per layer (keys, values) [K, Hkv, T, D], logits [K, T, V] or of the last column
    extend(ids_K_T, positions_K_T, kv, mask_K_T_W)   new tokens after kept prefixes (reuse)
        -> their keys/values written into kv [2 * layers, K, Hkv, P + T, D], logits [K, V]
           after each row's last new token
    decode(ids_B_1, positions_B_1, kv)     one token per row against `kv`'s window
        kv.write(layer, keys_B_Hkv_1_D, values_B_Hkv_1_D) -> window keys/values [B, Hkv, W+1, D]
        kv.mask_B_W (bool, True = attend)
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
import torch.nn.functional as F

__all__ = ["FastLM"]

_FAMILIES = {"llama", "mistral", "qwen2", "qwen3"}
_BUILT: weakref.WeakKeyDictionary[Any, FastLM | None] = weakref.WeakKeyDictionary()


class KVWindow(Protocol):
    def write(self, layer: int, keys: torch.Tensor,
              values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


# -- support check ---------------------------------------------------------------------------------

def why_unsupported(model: Any) -> str | None:
    """None when `FastLM` can run `model`, else the reason it cannot."""
    config: Any = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if config is None or kind not in _FAMILIES:
        return f"model_type {kind!r} is not one of {sorted(_FAMILIES)}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "not a *ForCausalLM with .model.layers and .lm_head"
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", "default") != "default":
        return f"rope type {getattr(rotary, 'rope_type', None)!r} (only 'default' is supported)"
    if getattr(config, "hidden_act", None) != "silu":
        return f"hidden_act {config.hidden_act!r} (only 'silu')"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if getattr(config, "_attn_implementation", "sdpa") not in ("sdpa", "eager", None):
        return f"attention implementation {config._attn_implementation!r}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return "sliding-window layers"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window",
                                                           None) is not False:
        return "sliding-window attention"  # mistral: set means used; qwen2: use_sliding_window
    for module in model.modules():
        if "FSDP" in type(module).__name__ or module._forward_pre_hooks or module._forward_hooks:
            return "wrapped or hooked modules (FSDP, adapters, hooks must see every forward)"
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        return "sharded (DTensor) parameters"
    norms = [inner.norm] + [n for layer in inner.layers
                            for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if not all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon")
               for n in norms):
        return "norms other than the family's RMSNorm"
    for layer in inner.layers:
        attn = layer.self_attn
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return "an attention module without q/k/v/o projections"
    return None


# -- the forward -----------------------------------------------------------------------------------

def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _mask_bias(mask_B_W: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a keep-mask: 0 where kept, the dtype's lowest value elsewhere."""
    bias_B_W = torch.zeros(mask_B_W.shape, dtype=dtype, device=mask_B_W.device)
    bias_B_W.masked_fill_(~mask_B_W, torch.finfo(dtype).min)
    return bias_B_W[:, None, None, :]


_BROADCAST_BUDGET = 1 << 20
"""Most elements (rows x heads x columns x head_dim) a decode step's attention takes as broadcast
products; past it the fused kernel is used (its setup cost no longer dominates)."""


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for a decode step.

    q [B, Hkv, G, D] (the G query heads of a KV head as its query rows) against keys/values
    [B, Hkv, W, D]. With a handful of query rows and columns per (row, head), the fused kernel
    and batched matmuls spend their time on per-matrix setup (~0.5-1 ms a call on a CPU at
    B=128), while one elementwise product over all of them takes tens of microseconds; `bias`
    (the mask in additive form) is given when that path is taken."""
    if bias is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    scores = (q.unsqueeze(-2) * keys.unsqueeze(2)).sum(-1) * scale + bias
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return (probs.unsqueeze(-1) * values.unsqueeze(2)).sum(-2)


class _Layer:
    """One decoder layer's modules (parameters are read at call time: updates are seen)."""

    __slots__ = ("ln1", "q", "k", "v", "o", "q_norm", "k_norm", "ln2", "gate", "up", "down",
                 "scaling")

    def __init__(self, layer: Any) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1, self.ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.q, self.k, self.v, self.o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.q_norm = getattr(attn, "q_norm", None)
        self.k_norm = getattr(attn, "k_norm", None)
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.scaling = attn.scaling


def _norm(x: torch.Tensor, module: Any) -> torch.Tensor:
    return _rms_norm(x, module.weight, module.variance_epsilon)


class FastLM:
    """The model's decoder as plain torch calls. Build with `FastLM.build(model)`."""

    def __init__(self, model: Any) -> None:
        config, inner = model.config, model.model
        self.model = model
        self.embed = inner.embed_tokens
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.rotary = inner.rotary_emb
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.groups = self.heads // self.kv_heads

    @classmethod
    def build(cls, model: Any) -> FastLM | None:
        """A FastLM for `model`, or None when the model is not one this module can run."""
        return None if why_unsupported(model) is not None else cls(model)

    @classmethod
    def of(cls, model: Any) -> FastLM | None:
        """`build(model)`, remembered per model (the trainer asks on every micro-batch)."""
        try:
            return _BUILT[model]
        except KeyError:
            built = _BUILT[model] = cls.build(model)
            return built

    # -- pieces ------------------------------------------------------------------------------------
    def _rope(self, positions_B_T: torch.Tensor, dtype: torch.dtype):
        inv_freq = self.rotary.inv_freq
        freqs = positions_B_T[..., None].float() * inv_freq.to(device=positions_B_T.device,
                                                               dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        scaling = self.rotary.attention_scaling
        cos_B_1_T_D = (emb.cos() * scaling).to(dtype).unsqueeze(1)
        sin_B_1_T_D = (emb.sin() * scaling).to(dtype).unsqueeze(1)
        return cos_B_1_T_D, sin_B_1_T_D

    def _qkv(self, layer: _Layer, h: torch.Tensor, cos, sin):
        B, T = h.shape[0], h.shape[1]
        shape = (B, T, -1, self.head_dim)
        q = layer.q(h).view(shape)
        k = layer.k(h).view(shape)
        if layer.q_norm is not None:
            q, k = _norm(q, layer.q_norm), _norm(k, layer.k_norm)
        q_B_H_T_D, k_B_Hkv_T_D = q.transpose(1, 2), k.transpose(1, 2)
        v_B_Hkv_T_D = layer.v(h).view(shape).transpose(1, 2)
        q_B_H_T_D = q_B_H_T_D * cos + _rotate_half(q_B_H_T_D) * sin
        k_B_Hkv_T_D = k_B_Hkv_T_D * cos + _rotate_half(k_B_Hkv_T_D) * sin
        return q_B_H_T_D, k_B_Hkv_T_D, v_B_Hkv_T_D

    def _finish_layer(self, layer: _Layer, x: torch.Tensor, attn_B_H_T_D: torch.Tensor):
        B, T = x.shape[0], x.shape[1]
        x = x + layer.o(attn_B_H_T_D.transpose(1, 2).reshape(B, T, -1))
        h = _norm(x, layer.ln2)
        return x + layer.down(F.silu(layer.gate(h)) * layer.up(h))

    def _causal(self, ids_B_T: torch.Tensor, positions_B_T: torch.Tensor
                ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Right-padded rows through every layer with plain causal attention: the last hidden
        states (before the final norm) and each layer's (keys, values) [B, Hkv, T, D]."""
        x = self.embed(ids_B_T)
        cos, sin = self._rope(positions_B_T, x.dtype)
        kv = []
        for layer in self.layers:
            h = _norm(x, layer.ln1)
            q, k, v = self._qkv(layer, h, cos, sin)
            kv.append((k, v))
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1,
                                                  scale=layer.scaling,
                                                  enable_gqa=self.groups > 1)
            x = self._finish_layer(layer, x, attn)
        return x, kv

    # -- calls -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids_K_T: torch.Tensor, positions_K_T: torch.Tensor, *, all_logits: bool
                ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        """Right-padded prompts through the model with causal attention.

        Returns each layer's (keys, values) [K, Hkv, T, D] and the logits: [K, T, V] with
        `all_logits`, else [K, 1, V] of the last column."""
        x, kv = self._causal(ids_K_T, positions_K_T)
        x = _norm(x if all_logits else x[:, -1:], self.norm)
        return kv, self.lm_head(x)

    @torch.inference_mode()
    def extend(self, ids_K_T: torch.Tensor, positions_K_T: torch.Tensor,
               kv_2L_K_H_W_D: torch.Tensor, mask_K_T_W: torch.Tensor,
               last_K: torch.Tensor | None = None) -> torch.Tensor:
        """Right-padded new tokens after each row's kept prefix (prefix reuse).

        `kv_2L_K_H_W_D` holds every layer's keys and values (k0, v0, k1, v1, ...) with the
        prefixes in its first W - T columns; the new tokens' keys/values are written into the
        last T. `mask_K_T_W` (True = attend) says which prefix columns are a row's own and keeps
        the new tokens causal. Returns the logits after column `last_K[i]` of each row [K, V]
        (None: of the last column)."""
        x = self.embed(ids_K_T)
        cos, sin = self._rope(positions_K_T, x.dtype)
        mask_K_1_T_W = mask_K_T_W[:, None]
        P = kv_2L_K_H_W_D.shape[3] - ids_K_T.shape[1]
        for index, layer in enumerate(self.layers):
            h = _norm(x, layer.ln1)
            q, k, v = self._qkv(layer, h, cos, sin)
            keys, values = kv_2L_K_H_W_D[2 * index], kv_2L_K_H_W_D[2 * index + 1]
            keys[:, :, P:], values[:, :, P:] = k, v
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask_K_1_T_W,
                                                  scale=layer.scaling,
                                                  enable_gqa=self.groups > 1)
            x = self._finish_layer(layer, x, attn)
        rows_K = torch.arange(x.shape[0], device=x.device)
        x_K_C = x[rows_K, last_K] if last_K is not None else x[:, -1]
        return self.lm_head(_norm(x_K_C, self.norm))

    def logits(self, ids_B_T: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of right-padded rows with causal attention, under autograd (the
        trainer's forward). Real tokens never see the padding after them, so their logits are
        the model's own with an attention mask (tests/test_fastlm.py)."""
        positions_B_T = torch.arange(ids_B_T.shape[1], device=ids_B_T.device).expand(
            ids_B_T.shape[0], -1)
        x, _ = self._causal(ids_B_T, positions_B_T)
        return self.lm_head(_norm(x, self.norm))

    @torch.inference_mode()
    def decode(self, ids_B_1: torch.Tensor, positions_B_1: torch.Tensor, mask_B_W: torch.Tensor,
               kv: KVWindow) -> torch.Tensor:
        """One new token per row; its keys/values go to `kv`. Returns logits [B, V]."""
        x = self.embed(ids_B_1)
        cos, sin = self._rope(positions_B_1, x.dtype)
        B = x.shape[0]
        mask_B_1_1_W = mask_B_W[:, None, None, :]
        size = B * self.heads * (mask_B_W.shape[1]) * self.head_dim
        bias_B_1_1_W = _mask_bias(mask_B_W, x.dtype) if size <= _BROADCAST_BUDGET else None
        for index, layer in enumerate(self.layers):
            h = _norm(x, layer.ln1)
            q, k, v = self._qkv(layer, h, cos, sin)
            keys, values = kv.write(index, k, v)
            if self.groups > 1:  # the query heads of one KV head act as its query rows
                q = q.reshape(B, self.kv_heads, self.groups, self.head_dim)
            attn = _attend(q, keys, values, mask_B_1_1_W, bias_B_1_1_W, layer.scaling)
            x = self._finish_layer(layer, x, attn.reshape(B, self.heads, 1, self.head_dim))
        x = _norm(x, self.norm)
        return self.lm_head(x)[:, -1]
