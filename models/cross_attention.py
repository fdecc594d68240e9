"""A classic cross-attention decoder: every layer is self-attention -> cross-attention over a memory -> MLP.

Each of the three sub-blocks is pre-norm (RMSNorm) with a plain residual, no gate (unlike `models/gca.py`, whose
zero-initialised gates protect a pretrained decoder; here the decoder is trained with its cross-attention from the
start, as the traffic-scene VLM's decoder is). Everything is transformers' Qwen3: the layer *is* a
`Qwen3DecoderLayer` (its `self_attn`, `mlp` and both norms keep Qwen3's names, so a Qwen3 layer's weights load by
name) with a cross-attention block added between its attention and its MLP; the cross-attention is a
`Qwen3Attention` (same q/k/v/o projections, QK-norm and GQA layout) whose forward reads the memory, without RoPE (the
memory is a set of vision patches or chunks, not a continuation of the text), through `scaled_dot_product_attention`.

**Memory width — decision: one shared projection.** The memory (width `memory_hidden_size`, e.g. 768 for SigLIP)
goes through one `memory_projection` (Linear to the decoder's width; none when the widths already match) and every
layer's k/v projections then read the projected memory, rather than each layer owning k/v projections from the
memory width. Why: the cross-attention layers stay exactly Qwen3Attention's shape (nothing re-implemented, weights
interchangeable with self-attention), the same projected memory is what GCA blocks and merged attention read (so the
three fusions differ only in how they attend, not in what they read), and it is the LLaVA/Mllama layout the seed
calls "cleaner, more standard". Parameters: mem*d + L*2*d*kv against L*2*mem*kv, so it is far cheaper when many
layers read a much wider memory (4096 into 1024 over 28 layers: 4.2M against 176M extra) and slightly dearer in the
traffic VLM's small configuration (768 into 512, 4 layers, kv 128: +0.13M). Its cost in expressiveness: every layer
reads the same d-wide view of the memory. The projection runs once per generation, like the k/v projections.

**Cache.** `EncoderDecoderCache`: the self-attention keys/values grow in its `self_attention_cache`; each layer's
memory keys/values are projected on the first forward into its `cross_attention_cache` (`is_updated`) and read
from there at every later step. Beam search reorders both. `generate` passes `memory` / `memory_mask` as model
kwargs (expanded for beams by GenerationMixin); once the cache holds them the memory is not read again.
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GenerationMixin, Qwen3Config
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from models.gca import MemoryKV, MemoryPadding, attend_memory


@strict
class Qwen3CrossAttentionConfig(Qwen3Config):
    """A Qwen3 decoder plus the width of the memory it reads (None: the decoder's own width)."""

    model_type = "qwen3_cross_attention"
    memory_hidden_size: int | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.memory_hidden_size is None:
            self.memory_hidden_size = self.hidden_size
        if self.use_sliding_window:
            raise ValueError("invalid Qwen3CrossAttentionConfig: use_sliding_window=True is not supported (every "
                             "layer's self-attention is full causal attention); set use_sliding_window=False")


class MemoryCrossAttention(Qwen3Attention):
    """Queries from the decoder stream, keys/values from the (projected) memory; QK-norm, GQA, no RoPE.

    Qwen3Attention's parameters and layout; only the forward differs (what the keys/values are made of)."""

    def __init__(self, config: Qwen3CrossAttentionConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        memory_states: torch.Tensor | None,
        memory_padding: MemoryPadding,
        cache: EncoderDecoderCache | None = None,
    ) -> torch.Tensor:
        """hidden_states (B, T, d) normed; memory_states (B, M, d) or None once cached -> (B, T, d)."""
        key, value = self.memory_keys_values(memory_states, cache)  # (B, H_kv, M, hd) each
        return self.attend(hidden_states, MemoryKV(key, value, memory_padding))

    def attend(self, hidden_states: torch.Tensor, memory: MemoryKV) -> torch.Tensor:
        """hidden_states (B, T, d) normed, B a multiple of the memory's batch (beams fold, as in GCA) -> (B, T, d)."""
        b, t, _ = hidden_states.shape
        query = self.q_norm(self.q_proj(hidden_states).view(b, t, -1, self.head_dim))  # (B, T, H, hd)
        dropout = self.attention_dropout if self.training else 0.0
        out, _ = attend_memory(query, memory, scale=self.scaling, dropout_p=dropout)  # (B, T, H*hd)
        return self.o_proj(out)

    def memory_keys_values(self, memory_states: torch.Tensor | None, cache: EncoderDecoderCache | None):
        """This layer's memory keys/values: from the cache once projected, else projected (and cached)."""
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            return layer.keys, layer.values
        if memory_states is None:
            raise ValueError("cross-attention needs the memory (or a cache that already holds its keys/values)")
        shape = (*memory_states.shape[:-1], -1, self.head_dim)  # (B, M, H_kv, hd)
        key = self.k_norm(self.k_proj(memory_states).view(shape)).transpose(1, 2)  # (B, H_kv, M, hd)
        value = self.v_proj(memory_states).view(shape).transpose(1, 2)  # (B, H_kv, M, hd)
        if cache is not None:
            key, value = cache.cross_attention_cache.update(key, value, self.layer_idx)
            cache.is_updated[self.layer_idx] = True
        return key, value


class CrossAttentionDecoderLayer(Qwen3DecoderLayer):
    """`x += self_attn(norm(x)); x += cross_attn(norm(x), memory); x += mlp(norm(x))`.

    A Qwen3DecoderLayer (so a GradientCheckpointingLayer: activation checkpointing covers it) with the
    cross-attention block and its norm added; its forward runs the three blocks in that order."""

    def __init__(self, config: Qwen3CrossAttentionConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.cross_attn_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.cross_attn = MemoryCrossAttention(config, layer_idx)

    def forward(
        self,
        hidden_states: torch.Tensor,
        memory_states: torch.Tensor | None,
        *,
        memory_padding: MemoryPadding,
        attention_mask: torch.Tensor | None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        cache: EncoderDecoderCache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, T, d), memory_states (B, M, d): positional, so reentrant checkpointing sends their
        gradients back."""
        self_cache = cache.self_attention_cache if cache is not None else None
        return self_cross_mlp(
            self, hidden_states,
            lambda h: self.cross_attn(self.cross_attn_layernorm(h), memory_states, memory_padding, cache),
            position_embeddings=position_embeddings, attention_mask=attention_mask, cache=self_cache, **kwargs,
        )


def self_cross_mlp(layer: nn.Module, hidden_states: torch.Tensor, read_memory, **self_attn_kwargs) -> torch.Tensor:
    """A transformers Qwen3 / Qwen3-MoE decoder layer's own blocks with a memory read between attention and MLP:
    `x += self_attn(input_layernorm(x)); x += read_memory(x); x += mlp(post_attention_layernorm(x))`.
    `read_memory(x)` returns the residual update (pre-norm inside). Shared by this decoder's layers and the
    Awareness model's `fusion="cross"` layers, which wrap a pretrained layer."""
    attended, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden_states), **self_attn_kwargs)
    hidden_states = hidden_states + attended
    hidden_states = hidden_states + read_memory(hidden_states)
    out = layer.mlp(layer.post_attention_layernorm(hidden_states))
    return hidden_states + (out[0] if isinstance(out, tuple) else out)


class Qwen3CrossAttentionDecoder(Qwen3PreTrainedModel):
    """Qwen3Model's layout (embed_tokens, layers, norm, rotary_emb) with a cross-attention block in every layer and
    the shared memory projection."""

    config: Qwen3CrossAttentionConfig
    config_class = Qwen3CrossAttentionConfig
    _no_split_modules = ["CrossAttentionDecoderLayer"]
    _can_record_outputs = None

    def __init__(self, config: Qwen3CrossAttentionConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.memory_projection = (
            nn.Linear(config.memory_hidden_size, config.hidden_size, bias=False)
            if config.memory_hidden_size != config.hidden_size else nn.Identity()
        )
        self.layers = nn.ModuleList(CrossAttentionDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """input_ids (B, T); memory (B, M, memory_hidden_size); memory_mask (B, M), True = real memory token;
        attention_mask (B, P+T) over the cached tokens too. A plain cache (what `generate` makes for a decoder-only
        model) becomes the self-attention half of an EncoderDecoderCache."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, length = inputs_embeds.shape[:2]
        if use_cache and not isinstance(cache, EncoderDecoderCache):
            cache = EncoderDecoderCache(cache or DynamicCache(config=self.config), DynamicCache())
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            if attention_mask is not None and attention_mask.dim() == 2:  # real tokens count: left padding is fine
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]  # (B, T)
            else:
                position_ids = torch.arange(past, past + length, device=inputs_embeds.device)[None]  # (1, T)
        self_cache = cache.self_attention_cache if cache is not None else None
        causal_mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                         cache=self_cache, position_ids=position_ids)
        memory_states, memory_padding = self._memory(memory, memory_mask, cache, batch)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, memory_states, memory_padding=memory_padding,
                                  attention_mask=causal_mask, position_embeddings=position_embeddings,
                                  cache=cache, use_cache=use_cache, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states),
                                       cache=cache if use_cache else None)

    def _memory(self, memory, memory_mask, cache, batch) -> tuple[torch.Tensor | None, MemoryPadding]:
        """The projected memory (None once every layer caches its keys/values: not projected again) and its
        padding, which every step needs (it is not cached)."""
        cached = cache is not None and all(cache.is_updated.get(i) for i in range(len(self.layers)))
        if memory is None and not cached:
            raise ValueError("the cross-attention decoder needs `memory` (B, M, memory_hidden_size)")
        if memory_mask is not None and (memory_mask.dim() != 2 or memory_mask.shape[0] != batch):
            raise ValueError(f"memory_mask has shape {tuple(memory_mask.shape)}, expected ({batch}, M): True = real")
        padding = MemoryPadding(None, None) if memory_mask is None else MemoryPadding.from_mask(memory_mask.bool())
        return (None if cached else self.memory_projection(memory)), padding


class Qwen3CrossAttentionForCausalLM(Qwen3PreTrainedModel, GenerationMixin):
    """The decoder plus an LM head (tied to the input embeddings when `tie_word_embeddings`); `generate` with
    greedy / sampling / beam search, `save_pretrained` / `from_pretrained` through safetensors."""

    config: Qwen3CrossAttentionConfig
    config_class = Qwen3CrossAttentionConfig
    _no_split_modules = ["CrossAttentionDecoderLayer"]
    _can_record_outputs = None
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Qwen3CrossAttentionConfig):
        super().__init__(config)
        self.model = Qwen3CrossAttentionDecoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """As the decoder's forward; labels (B, T) are the inputs themselves (shifted inside the loss), -100 ignored.
        Attention weights and hidden states are not returned (SDPA never materialises the weights)."""
        for unused in ("output_attentions", "output_hidden_states", "return_dict"):
            kwargs.pop(unused, None)
        outputs = self.model(input_ids=input_ids, memory=memory, memory_mask=memory_mask,
                             attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                             inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))  # (B, T, V)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=outputs.cache)
