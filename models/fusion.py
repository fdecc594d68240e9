"""How a pretrained decoder reads the projected memory (`AwarenessModel(fusion=...)`): the three ways of the seeds,
each on the same pair, the same memory encoder and the same projection, so a comparison differs only in how it
attends.

* `gca`: gated cross-attention blocks before chosen layers (`models/gca.py`), gates at 0.
* `cross`: classic cross-attention in every layer between self-attention and MLP, pre-norm, plain residual, no gate:
  the layer of `models/cross_attention.py` (its `MemoryCrossAttention` and `self_cross_mlp`) wrapped around the
  pretrained layer. **Init: o_proj at zero**, so at step 0 the decoder is exactly the pretrained one (what GCA's
  closed gate gives), yet no saddle: o_proj's gradient is the attention output (non-zero from the first step) times
  the upstream gradient, and q/k/v get gradients as soon as o_proj leaves zero (the reasoning of LoRA's B = 0).
* `merged`: T5Gemma 2-style: each layer's own self-attention also attends over the memory, through its own q/k/v/o
  projections and QK-norm, in one softmax with the causal part (`models/seq2seq/model.py`'s code path); memory keys
  unrotated (RoPE decision in docs/seq2seq.md). Adds no parameters beyond the projection: it trains through the decoder
  (LoRA or full). Before training the decoder already reads the memory (its attention spreads over it): only a
  fully masked memory leaves it unchanged.

The memory reaches the layers as `gca_memory` (a GCAMemory: per layer keys/values computed once per forward or
generation) through the `**kwargs` that transformers threads through Qwen3ForCausalLM to every layer and, for
merged, on to the layer's attention.
"""

from __future__ import annotations


import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention

from models.cross_attention import MemoryCrossAttention, self_cross_mlp
from models.gca import ChunkRouter, GCAMemory, MemoryKV, MemoryPadding
from models.seq2seq.model import merged_attention, self_queries_keys_values
from models.specs import FUSIONS



def check_fusion(fusion: str) -> str:
    if fusion not in FUSIONS:
        raise ValueError(f"fusion must be one of {FUSIONS} (gca: gated blocks in gca_layers; cross: cross-attention "
                         f"in every layer; merged: every layer's self-attention also reads the memory), got {fusion!r}")
    return fusion


class FusedCrossAttention(MemoryCrossAttention):
    """The cross-attention block `fusion="cross"` adds to a pretrained layer: the residual update
    `o(attn(q(norm(x)), k(mem), v(mem)))`, Qwen3Attention's projections, QK-norm and GQA, no RoPE, no gate; o_proj
    starts at zero (AwarenessModel's init). With `router` it also has chunk routing's summary keys (models/gca.py)."""

    def __init__(self, config, layer_idx: int, router: bool = False):
        super().__init__(config, layer_idx)
        self.input_norm = modeling_qwen3.Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        kv_heads = config.num_key_value_heads
        self.router = ChunkRouter(config.hidden_size, kv_heads, self.head_dim, config.rms_norm_eps) if router else None

    def project_memory(self, memory_states: torch.Tensor, padding: MemoryPadding) -> MemoryKV:
        """memory_states (B, M, d) projected to the decoder's width -> this layer's keys and values."""
        key, value = self.memory_keys_values(memory_states, None)  # (B, H_kv, M, hd) each
        return MemoryKV(key=key, value=value, padding=padding)

    def forward(self, hidden_states: torch.Tensor, memory: MemoryKV) -> torch.Tensor:  # type: ignore[override]
        """hidden_states (B, T, d), B a multiple of the memory's batch -> the update (B, T, d)."""
        return self.attend(self.input_norm(hidden_states), memory)


class CrossReadingLayer(GradientCheckpointingLayer):
    """A pretrained transformers decoder layer with a cross-attention block between its attention and its MLP.
    Without memory it is the wrapped layer, untouched. Named like gca.MemoryReadingLayer (`decoder_layer`,
    `cross_attention`), so LoRA targets, train groups and saved names are the same for both fusions."""

    def __init__(self, decoder_layer: nn.Module, cross_attention: FusedCrossAttention, layer_idx: int):
        super().__init__()
        self.decoder_layer = decoder_layer
        self.cross_attention = cross_attention
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, gca_memory: GCAMemory | None = None, **kwargs) -> torch.Tensor:
        if gca_memory is None:
            return self.decoder_layer(hidden_states, **kwargs)
        memory = gca_memory.layers[self.layer_idx]
        return self_cross_mlp(self.decoder_layer, hidden_states, lambda h: self.cross_attention(h, memory), **kwargs)


class MemoryMergedAttention:
    """Mixed into the decoder's own attention class (`adopt_merged_attention`): with `gca_memory` it attends over
    its own keys/values and the memory's in one softmax; without, it is the pretrained attention. Same parameters
    and names: nothing is added."""

    def project_memory(self, memory_states: torch.Tensor, padding: MemoryPadding) -> MemoryKV:
        """memory_states (B, M, d) -> keys/values through this attention's own k/v projections and k_norm."""
        shape = (*memory_states.shape[:-1], -1, self.head_dim)  # (B, M, H_kv, hd)
        key = self.k_norm(self.k_proj(memory_states).view(shape)).transpose(1, 2)  # (B, H_kv, M, hd)
        value = self.v_proj(memory_states).view(shape).transpose(1, 2)  # (B, H_kv, M, hd)
        return MemoryKV(key=key, value=value, padding=padding)

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None,
                gca_memory: GCAMemory | None = None, **kwargs):
        if gca_memory is None:
            return super().forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        memory = gca_memory.layers[self.layer_idx]
        query, key, value = self_queries_keys_values(self, hidden_states, position_embeddings, cache)
        b, t = hidden_states.shape[:2]
        r = b // memory.key.shape[0]  # beams / several questions per memory: row i reads memory i // r
        memory_key, memory_value = (x.repeat_interleave(r, dim=0) if r > 1 else x for x in (memory.key, memory.value))
        mask = torch.cat([_self_mask(attention_mask, b, t, key.shape[2], query.device),
                          _memory_mask(memory.padding, b, t, memory.key.shape[2], r, query.device)], dim=-1)
        return merged_attention(self, query, torch.cat([key, memory_key], dim=2),
                                torch.cat([value, memory_value], dim=2), mask)


class MergedQwen3Attention(MemoryMergedAttention, Qwen3Attention):
    pass


class MergedQwen3MoeAttention(MemoryMergedAttention, Qwen3MoeAttention):
    pass


_MERGED = {Qwen3Attention: MergedQwen3Attention, Qwen3MoeAttention: MergedQwen3MoeAttention}


def adopt_merged_attention(attention: nn.Module) -> nn.Module:
    """Turns a layer's pretrained attention into its merged-attention class in place: same object, parameters and
    names (a Qwen3 state dict and PEFT's LoRA targets keep working), only the forward learns to read the memory."""
    merged = _MERGED.get(type(attention))
    if merged is None:
        raise ValueError(f"fusion='merged' reads the memory through a Qwen3 / Qwen3-MoE attention, not "
                         f"{type(attention).__name__}")
    if attention.sliding_window:
        raise ValueError("fusion='merged' needs full attention: the decoder uses a sliding window (set "
                         "use_sliding_window=False)")
    attention.__class__ = merged
    return attention


def _self_mask(attention_mask: torch.Tensor | None, b: int, t: int, keys: int, device) -> torch.Tensor:
    """transformers' mask for the self part, as (B, 1, T, P+T) bool, True = attend: None (SDPA's plain causal case)
    becomes the causal mask at the cache's offset; a float (eager) mask is read as 0 = attend."""
    if attention_mask is None:
        query_pos = torch.arange(keys - t, keys, device=device)[:, None]  # (T, 1)
        return (torch.arange(keys, device=device)[None, :] <= query_pos).expand(b, 1, t, keys)
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    return attention_mask[..., -keys:].expand(b, 1, t, keys)


def _memory_mask(padding: MemoryPadding, b: int, t: int, m: int, r: int, device) -> torch.Tensor:
    """The memory part (B, 1, T, M): real memory tokens only. Unlike a cross-attention, a row whose memory is all
    padding masks all of it (its own tokens keep the softmax defined)."""
    if padding.attn_mask is None:
        return torch.ones(b, 1, t, m, dtype=torch.bool, device=device)
    mask = padding.attn_mask
    if padding.has_memory is not None:
        mask = mask & padding.has_memory.bool()
    if r > 1:
        mask = mask.repeat_interleave(r, dim=0)
    return mask.expand(b, 1, t, m)
