"""Gated cross-attention (GCA): a pretrained decoder layer reads the encoder memory.

Design (after Flamingo, Mllama and torchtune's `FusionLayer`/`TanhGate`):

* The GCA block sits *before* the wrapped transformers decoder layer, so the layer's own forward runs untouched
  (no second copy of Qwen3) and its self-attention and MLP then process what the block wrote into the stream.
* Pre-norm (RMSNorm) on the decoder stream, queries from the decoder, keys/values from the memory, the decoder's
  GQA layout and per-head QK-norm, no RoPE on memory keys (memory is a set of chunks, each prefixed with its path),
  attention through `scaled_dot_product_attention`.
* The residual update is scaled by `tanh(gate)` with `gate` initialised at 0, so at initialisation the model is
  exactly the pretrained decoder.
* A gated MLP after the cross-attention (Flamingo/Mllama) is optional and off by default: the wrapped layer's own
  MLP follows immediately, the extra MLP would add 3·d·d_ff parameters per layer (1.8B for the 8B pair's 12 GCA
  layers), and in our needle runs its gate stayed below 0.02 (shared/notes/needle-feasibility.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm


@dataclass
class MemoryKV:
    """One GCA layer's keys and values over the memory, computed once per forward or generation."""

    key: torch.Tensor  # (B_mem, n_kv_heads, M, head_dim)
    value: torch.Tensor  # (B_mem, n_kv_heads, M, head_dim)
    padding: "MemoryPadding"


@dataclass
class MemoryPadding:
    """The memory's padding in the form attention needs it, derived once and shared by every GCA layer."""

    attn_mask: torch.Tensor | None  # (B_mem, 1, 1 or T, M) bool, True = attend; None when nothing is padded (fastest SDPA)
    has_memory: torch.Tensor | None  # (B_mem, 1, 1 or T, 1) 0/1; None when every row has at least one real token

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> "MemoryPadding":
        """mask (B_mem, M) bool. A row whose memory is all padding attends to its (zeroed) states and then has its
        output dropped, instead of producing NaN from an empty softmax."""
        if bool(mask.all()):
            return cls(attn_mask=None, has_memory=None)
        has_memory = mask.any(dim=-1)  # (B_mem,)
        attn_mask = (mask | ~has_memory[:, None])[:, None, None, :]
        return cls(attn_mask=attn_mask, has_memory=None if bool(has_memory.all()) else has_memory[:, None, None, None])

    @classmethod
    def packed(cls, mask: torch.Tensor, memory_segments: torch.Tensor, query_segments: torch.Tensor) -> "MemoryPadding":
        """Several examples packed into one row: a query token reads only its own example's memory.
        mask, memory_segments (B, M); query_segments (B, T); segment ids < 0 belong to no example (padding)."""
        allowed = query_segments[:, :, None] == memory_segments[:, None, :]  # (B, T, M)
        allowed &= mask[:, None, :] & (query_segments >= 0)[:, :, None]
        has_memory = allowed.any(dim=-1)  # (B, T)
        attn_mask = (allowed | ~has_memory[..., None])[:, None]  # (B, 1, T, M)
        return cls(attn_mask=attn_mask, has_memory=has_memory[:, None, :, None])


class GatedCrossAttention(GradientCheckpointingLayer):
    """`x + tanh(gate) * o(attn(q(norm(x)), k(mem), v(mem)))`, optionally followed by a gated MLP.

    A GradientCheckpointingLayer, so activation checkpointing covers it as it covers transformers' own layers.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float = 1e-6,
        attention_bias: bool = False,
        mlp_intermediate_size: int | None = None,
        hidden_act: str = "silu",
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.input_norm = Qwen3RMSNorm(hidden_size, eps=rms_norm_eps)
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=attention_bias)
        self.q_norm = Qwen3RMSNorm(head_dim, eps=rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(head_dim, eps=rms_norm_eps)
        self.gate = nn.Parameter(torch.zeros(1))
        self.probe_entropy = False  # when set, forward also records the attention entropy over the memory
        self.last_entropy: torch.Tensor | None = None
        self.probe_attention = False  # when set, forward also keeps the attention over the memory (evaluation)
        self.last_attention: torch.Tensor | None = None  # (B_mem, H, r*T, M)
        self.mlp = None
        if mlp_intermediate_size:
            mlp_config = _MLPConfig(hidden_size, mlp_intermediate_size, hidden_act)
            self.mlp_norm = Qwen3RMSNorm(hidden_size, eps=rms_norm_eps)
            self.mlp = Qwen3MLP(mlp_config)
            self.mlp_gate = nn.Parameter(torch.zeros(1))

    def project_memory(self, memory_states: torch.Tensor, padding: "MemoryPadding | torch.Tensor") -> MemoryKV:
        """memory_states (B, M, hidden) in the decoder's width -> this layer's keys and values.
        `padding` is a MemoryPadding, or the (B, M) bool mask to derive it from."""
        if isinstance(padding, torch.Tensor):
            padding = MemoryPadding.from_mask(padding.bool())
        b, m, _ = memory_states.shape
        kv_shape = (b, m, self.num_kv_heads, self.head_dim)
        key = self.k_norm(self.k_proj(memory_states).view(kv_shape)).transpose(1, 2)  # (B, n_kv, M, hd)
        value = self.v_proj(memory_states).view(kv_shape).transpose(1, 2)  # (B, n_kv, M, hd)
        return MemoryKV(key=key, value=value, padding=padding)

    def forward(self, hidden_states: torch.Tensor, memory: MemoryKV) -> torch.Tensor:
        """hidden_states (B, T, hidden); B may be r * B_mem (beams, several questions per memory): row i reads
        memory i // r, by folding the r rows into the query length instead of copying the memory r times."""
        attended = self._attend(self.input_norm(hidden_states), memory)
        hidden_states = hidden_states + self.gate.tanh() * attended
        if self.mlp is not None:
            hidden_states = hidden_states + self.mlp_gate.tanh() * self.mlp(self.mlp_norm(hidden_states))
        return hidden_states

    def _attend(self, x: torch.Tensor, memory: MemoryKV) -> torch.Tensor:
        b, t, _ = x.shape
        query = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim))  # (B, T, H, hd)
        out, folded = attend_memory(query, memory)  # (B, T, H*hd), (B_mem, H, r*T, hd)
        if self.probe_entropy or self.probe_attention:
            probs = self._probabilities(folded.detach(), memory)
            if self.probe_entropy:  # mean entropy (nats): it should fall as the blocks learn to look up
                self.last_entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1).mean()
            if self.probe_attention:
                self.last_attention = probs
        return self.o_proj(out)

    def _probabilities(self, query: torch.Tensor, memory: MemoryKV) -> torch.Tensor:
        """The attention over memory tokens (B_mem, H, r*T, M) that SDPA computed without keeping it: materialised
        only when probed (logging steps, evaluation)."""
        key = memory.key.detach().repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)  # (B_mem, H, M, hd)
        scores = (query @ key.transpose(-1, -2)).float() * self.head_dim**-0.5  # (B_mem, H, r*T, M)
        if memory.padding.attn_mask is not None:
            scores = scores.masked_fill(~memory.padding.attn_mask, float("-inf"))
        return scores.softmax(-1)


def attend_memory(query: torch.Tensor, memory: MemoryKV, *, scale: float | None = None,
                  dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (B, T, H, hd), QK-normed, over one memory-reading layer's keys/values -> (B, T, H*hd), and the queries
    as attended, (B_mem, H, r*T, hd). B may be r * B_mem (beams, several questions per memory): row i reads memory
    i // r, by folding the r rows into the query length instead of copying the memory r times. A row whose memory is
    all padding reads nothing (zeros, not NaN). Shared by GCA blocks and the cross-attention layers."""
    b, t, h, hd = query.shape
    b_mem = memory.key.shape[0]
    if b % b_mem:
        raise ValueError(f"decoder batch {b} is not a multiple of the memory batch {b_mem}")
    r = b // b_mem
    padding = memory.padding
    if r != 1 and padding.attn_mask is not None and padding.attn_mask.shape[2] != 1:
        raise ValueError("packed memory masks are per query token: pass one memory row per decoder row")
    folded = query.reshape(b_mem, r * t, h, hd).transpose(1, 2)  # (B_mem, H, r*T, hd)
    out = F.scaled_dot_product_attention(folded, memory.key, memory.value, attn_mask=padding.attn_mask,
                                         dropout_p=dropout_p, scale=scale,
                                         enable_gqa=h != memory.key.shape[1])  # (B_mem, H, r*T, hd)
    if padding.has_memory is not None:
        out = out * padding.has_memory.to(out.dtype)
    return out.transpose(1, 2).reshape(b, t, h * hd), folded  # (B, T, H*hd)


@dataclass
class _MLPConfig:
    """The three fields transformers' Qwen3MLP reads from a config."""

    hidden_size: int
    intermediate_size: int
    hidden_act: str


class MemoryReadingLayer(nn.Module):
    """A transformers decoder layer with a GCA block in front of it.

    The memory arrives as the `gca_memory` keyword that `Qwen3ForCausalLM.forward` threads through its `**kwargs`
    down to every layer; layers without a block ignore it.
    """

    def __init__(self, decoder_layer: nn.Module, cross_attention: GatedCrossAttention, layer_idx: int):
        super().__init__()
        self.cross_attention = cross_attention
        self.decoder_layer = decoder_layer
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, *args, gca_memory: "GCAMemory | None" = None, **kwargs):
        if gca_memory is not None:
            kv = gca_memory.layers[self.layer_idx]
            hidden_states = self.cross_attention(hidden_states, kv)
        return self.decoder_layer(hidden_states, *args, **kwargs)


@dataclass
class GCAMemory:
    """Everything the GCA layers read: keys/values per layer, computed once and reused at every decoding step."""

    layers: dict[int, MemoryKV]
    states: torch.Tensor  # (B_mem, M, decoder hidden): the projected memory, kept for inspection and logging
    mask: torch.Tensor  # (B_mem, M) bool

    @property
    def batch_size(self) -> int:
        return self.mask.shape[0]


def gca_parameter_count(
    *,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_gca_layers: int,
    encoder_hidden_size: int,
    attention_bias: bool = False,
    mlp_intermediate_size: int | None = None,
) -> int:
    """Closed form of the parameters AwarenessModel adds to the pair: GCA blocks plus the shared projection."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    attention = hidden_size + hidden_size * q + 2 * hidden_size * kv + q * hidden_size + 2 * head_dim + 1
    if attention_bias:
        attention += q + 2 * kv + hidden_size
    mlp = hidden_size + 3 * hidden_size * mlp_intermediate_size + 1 if mlp_intermediate_size else 0
    projection = encoder_hidden_size * hidden_size if encoder_hidden_size != hidden_size else 0
    return num_gca_layers * (attention + mlp) + projection
