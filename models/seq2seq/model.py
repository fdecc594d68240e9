"""A Qwen3 encoder-decoder with T5Gemma 2-style merged attention, initialised from one decoder-only Qwen3 checkpoint.

- `Qwen3EncoderModel`: transformers' `Qwen3Model` run bidirectionally (its checkpoints are plain Qwen3 checkpoints, so
  the extracted encoder loads anywhere a Qwen3Model does, e.g. as the Awareness memory encoder).
- `Qwen3MergedDecoder`: transformers' `Qwen3DecoderLayer`s whose attention is `Qwen3MergedAttention`: queries from the
  decoder, keys/values over concat(decoder, encoder) through the *same* q/k/v/o projections and QK-norm, causal over
  the decoder part, full over the (unpadded) encoder part. Weight names are Qwen3's, so a Qwen3 state dict loads as is.
- `Qwen3ForSeq2SeqLM`: both plus a tied LM head, generation through `GenerationMixin`. The encoder's keys/values are
  projected once per generation into `EncoderDecoderCache.cross_attention_cache` (as T5Gemma 2 does) and read from
  there at every later step; beam search reorders them with the cache.

RoPE on encoder keys: `encoder_key_rope="none"` (T5Gemma 2: encoder keys unrotated, every encoder token at the same
relative distance) or `"encoder_positions"` (rotated by their own positions 0..S-1). The default is "none": see
tests/models/seq2seq/test_model.py::test_rope_decision and docs/seq2seq.md for the measurement that chose it.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import GenerationMixin, Qwen3Config
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.masking_utils import create_bidirectional_mask
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPast, Seq2SeqLMOutput
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.qwen3.modeling_qwen3 import (Qwen3Attention, Qwen3DecoderLayer, Qwen3Model,
                                                      Qwen3PreTrainedModel, Qwen3RMSNorm, Qwen3RotaryEmbedding,
                                                      apply_rotary_pos_emb, eager_attention_forward, rotate_half)
from transformers.utils.output_capturing import capture_outputs

from models.loading import load_decoder

ENCODER_KEY_ROPE = ("none", "encoder_positions")
_ENCDEC_FIELDS = ("encoder_layers", "encoder_key_rope", "decoder_start_token_id", "is_encoder_decoder")


@strict
class Qwen3EncoderDecoderConfig(Qwen3Config):
    """A Qwen3 architecture (shared by encoder and decoder: one width, one vocabulary, tied embeddings) plus the
    encoder-decoder fields. Encoder and decoder share the width because the decoder's k/v projections read the
    encoder's states."""

    model_type = "qwen3_encdec"
    encoder_layers: int | None = None  # None: as many as the decoder (the T5Gemma recipe copies every layer)
    encoder_key_rope: str = "none"  # "none" (T5Gemma 2) | "encoder_positions"
    decoder_start_token_id: int | None = None  # the decoder's first input; labels are shifted right behind it
    is_encoder_decoder: bool = True

    def __post_init__(self, **kwargs):
        if self.encoder_layers is None:
            self.encoder_layers = self.num_hidden_layers
        self.is_encoder_decoder = True  # always: GenerationMixin reads it to run the encoder once, then decode
        super().__post_init__(**kwargs)
        problems = []
        if self.encoder_key_rope not in ENCODER_KEY_ROPE:
            problems.append(f"encoder_key_rope must be one of {ENCODER_KEY_ROPE}, got {self.encoder_key_rope!r}")
        if self.encoder_layers < 1:
            problems.append(f"encoder_layers must be >= 1, got {self.encoder_layers}")
        if self.use_sliding_window:
            problems.append("use_sliding_window=True: merged attention spans the whole decoder and encoder; set "
                            "use_sliding_window=False (every released dense Qwen3 checkpoint has it off)")
        if problems:
            raise ValueError("invalid Qwen3EncoderDecoderConfig: " + "; ".join(problems))

    def encoder_config(self) -> Qwen3Config:
        """The encoder's plain Qwen3Config: full attention everywhere (no sliding window), its own layer count."""
        fields = {k: v for k, v in self.to_dict().items() if k not in (*_ENCDEC_FIELDS, "model_type", "layer_types",
                                                                      "transformers_version", "architectures")}
        fields.update(num_hidden_layers=self.encoder_layers, use_sliding_window=False, tie_word_embeddings=False)
        config = Qwen3Config(**fields)
        config._attn_implementation = self._attn_implementation
        return config


# ------------------------------------------------------------------------------------------------------ encoder
class Qwen3EncoderModel(Qwen3Model):
    """Qwen3Model with bidirectional attention: every token sees the whole (unpadded) sequence.

    Positions count real tokens only, so left and right padding give the same states; padded positions come out as
    zeros (never NaN, even for an all-padding row), so they cannot leak into anything that reads them."""

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        for layer in self.layers:
            layer.self_attn.is_causal = False  # belt and braces: SDPA also gets is_causal=False below

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, **kwargs):
        for unused in ("use_cache", "cache", "is_causal"):
            kwargs.pop(unused, None)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds to the encoder")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        padding = attention_mask if attention_mask is not None and not isinstance(attention_mask, dict) else None
        if position_ids is None and padding is not None and padding.dim() == 2:
            position_ids = (padding.long().cumsum(-1) - 1).clamp(min=0)  # (B, S): real tokens count
        with _materialised_attention(self.config, kwargs.get("output_attentions", False)):
            if not isinstance(attention_mask, dict):
                full = create_bidirectional_mask(config=self.config, inputs_embeds=inputs_embeds,
                                                 attention_mask=attention_mask)
                attention_mask = {"full_attention": full}
            out: BaseModelOutputWithPast = super().forward(
                inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=False, is_causal=False, **kwargs,
            )
        if padding is not None and padding.dim() == 2:
            out.last_hidden_state = out.last_hidden_state.masked_fill(~padding.bool()[..., None], 0.0)
        return out

    @classmethod
    def from_seq2seq(cls, model: "Qwen3ForSeq2SeqLM") -> "Qwen3EncoderModel":
        """The seq2seq model's encoder as a standalone model with its own copy of the weights (embeddings included:
        they are tied to the decoder and LM head inside the seq2seq model, so sharing them would couple the two)."""
        encoder = cls(copy.deepcopy(model.encoder.config))
        encoder.load_state_dict(model.encoder.state_dict())
        return encoder.to(model.dtype).to(model.device).train(model.training)


@contextmanager
def _materialised_attention(config, enabled: bool):
    """Switches transformers' Qwen3 attention to its eager kernel for one call, so `output_attentions=True` returns
    the weights; SDPA (which never materialises them) otherwise."""
    if not enabled:
        yield
        return
    previous = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = previous


# ------------------------------------------------------------------------------------------------------ decoder
class Qwen3MergedAttention(Qwen3Attention):
    """One attention over decoder and encoder tokens with Qwen3's own projections, QK-norm and GQA.

    Queries come from the decoder (RoPE at decoder positions). Keys/values: the decoder's (RoPE'd, cached in the
    self-attention cache) followed by the encoder's (k_norm'd; RoPE'd at encoder positions only when
    `encoder_key_rope="encoder_positions"`), projected once and kept in the cross-attention cache."""

    def __init__(self, config: Qwen3EncoderDecoderConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.is_causal = False  # the merged mask carries the causal part
        self.encoder_key_rope = config.encoder_key_rope

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,
        cache: EncoderDecoderCache | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states (B, T, H); attention_mask (B, 1, T, P+T+S) bool -> (B, T, H), weights (B, nh, T, P+T+S)."""
        self_cache = cache.self_attention_cache if cache is not None else None
        query, key, value = self_queries_keys_values(self, hidden_states, position_embeddings, self_cache)
        cross_key, cross_value = self.encoder_keys_values(encoder_hidden_states, encoder_position_embeddings,
                                                          cache)  # (B, nkv, S, hd)
        return merged_attention(self, query, torch.cat([key, cross_key], dim=2), torch.cat([value, cross_value], dim=2),
                                attention_mask, output_attentions=output_attentions)

    def encoder_keys_values(self, encoder_hidden_states, encoder_position_embeddings, cache):
        """The encoder's keys/values for this layer: from the cache once projected, else projected (and cached)."""
        if cache is not None and cache.is_updated.get(self.layer_idx):
            layer = cache.cross_attention_cache.layers[self.layer_idx]
            return layer.keys, layer.values
        if encoder_hidden_states is None:
            raise ValueError("the merged-attention decoder needs encoder_hidden_states (or a cache holding them)")
        shape = (*encoder_hidden_states.shape[:-1], -1, self.head_dim)
        key = self.k_norm(self.k_proj(encoder_hidden_states).view(shape)).transpose(1, 2)  # (B, nkv, S, hd)
        value = self.v_proj(encoder_hidden_states).view(shape).transpose(1, 2)
        if self.encoder_key_rope == "encoder_positions":
            cos, sin = (t.unsqueeze(1) for t in encoder_position_embeddings)  # (B, 1, S, hd)
            key = key * cos + rotate_half(key) * sin
        if cache is not None:
            key, value = cache.cross_attention_cache.update(key, value, self.layer_idx)
            cache.is_updated[self.layer_idx] = True
        return key, value


def self_queries_keys_values(attention: nn.Module, hidden_states: torch.Tensor,
                             position_embeddings: tuple[torch.Tensor, torch.Tensor], cache=None):
    """A Qwen3 attention's own queries (B, nh, T, hd) and keys/values (B, nkv, P+T, hd): QK-norm, RoPE at the decoder
    positions, the keys/values appended to `cache` (a self-attention Cache) when given. Shared by this decoder and
    the Awareness model's `fusion="merged"` layers."""
    hidden_shape = (*hidden_states.shape[:-1], -1, attention.head_dim)
    query = attention.q_norm(attention.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)  # (B, nh, T, hd)
    key = attention.k_norm(attention.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)  # (B, nkv, T, hd)
    value = attention.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, nkv, T, hd)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    if cache is not None:
        key, value = cache.update(key, value, attention.layer_idx)  # (B, nkv, P+T, hd)
    return query, key, value


def merged_attention(attention: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     mask: torch.Tensor, *,
                     output_attentions: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One attention of the decoder's queries (B, nh, T, hd) over its own and the other model's keys/values
    (B, nkv, P+T+S, hd) under one bool mask (B, 1, T, P+T+S), True = attend, then the attention's o_proj
    -> (B, T, H), weights (B, nh, T, P+T+S) when `output_attentions` (eager), else None (SDPA)."""
    dropout = attention.attention_dropout if attention.training else 0.0
    if output_attentions:
        additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        additive = additive.masked_fill(~mask, torch.finfo(query.dtype).min)
        output, weights = eager_attention_forward(attention, query, key, value, additive, attention.scaling, dropout)
    else:
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                scale=attention.scaling, enable_gqa=True)  # (B, nh, T, hd)
        output, weights = output.transpose(1, 2), None  # (B, T, nh, hd)
    return attention.o_proj(output.reshape(*output.shape[:2], -1).contiguous()), weights


def merged_attention_mask(decoder_mask: torch.Tensor, encoder_mask: torch.Tensor, query_len: int) -> torch.Tensor:
    """decoder_mask (B, P+T) and encoder_mask (B, S), True = real token -> (B, 1, T, P+T+S) bool, True = attend.

    Decoder part: causal and unpadded; encoder part: every real encoder token. A padded query also sees itself, so
    no row is empty (SDPA would return NaN there); its output is never read."""
    batch, total = decoder_mask.shape
    past = total - query_len
    query_pos = torch.arange(past, total, device=decoder_mask.device)[:, None]  # (T, 1)
    key_pos = torch.arange(total, device=decoder_mask.device)[None, :]  # (1, P+T)
    self_part = (key_pos <= query_pos)[None] & decoder_mask[:, None, :]  # (B, T, P+T)
    self_part = self_part | (key_pos == query_pos)[None]
    cross_part = encoder_mask[:, None, :].expand(batch, query_len, encoder_mask.shape[1])  # (B, T, S)
    return torch.cat([self_part, cross_part], dim=-1)[:, None]  # (B, 1, T, P+T+S)


class Qwen3MergedDecoder(Qwen3PreTrainedModel):
    """Qwen3Model's layout (embed_tokens, layers, norm, rotary_emb) with merged attention in every layer."""

    config: Qwen3EncoderDecoderConfig
    _can_record_outputs = {"hidden_states": Qwen3DecoderLayer, "attentions": Qwen3MergedAttention}

    def __init__(self, config: Qwen3EncoderDecoderConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList()
        for i in range(config.num_hidden_layers):
            layer = Qwen3DecoderLayer(config, i)
            layer.self_attn = Qwen3MergedAttention(config, i)  # same parameter names as Qwen3Attention
            self.layers.append(layer)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: EncoderDecoderCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        """attention_mask (B, P+T) covers the cached tokens too; encoder_attention_mask (B, S)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of decoder_input_ids or decoder_inputs_embeds")
        if encoder_hidden_states is None:
            raise ValueError("the decoder needs encoder_hidden_states: run the encoder first (or pass encoder_outputs)")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        batch, length = inputs_embeds.shape[:2]
        if use_cache and cache is None:
            cache = EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache())
        past = cache.get_seq_length() if cache is not None else 0
        device = inputs_embeds.device
        decoder_mask = _bool_mask(attention_mask, batch, past + length, device, "decoder_attention_mask")
        encoder_mask = _bool_mask(encoder_attention_mask, batch, encoder_hidden_states.shape[1], device,
                                  "attention_mask (the encoder's)")
        if position_ids is None:
            position_ids = (decoder_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]  # (B, T)
        mask = merged_attention_mask(decoder_mask, encoder_mask, length)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        encoder_position_embeddings = None
        if self.config.encoder_key_rope == "encoder_positions":
            encoder_positions = (encoder_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, S)
            encoder_position_embeddings = self.rotary_emb(encoder_hidden_states, encoder_positions)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, attention_mask=mask, position_ids=position_ids, cache=cache,
                use_cache=use_cache, position_embeddings=position_embeddings,
                encoder_hidden_states=encoder_hidden_states, encoder_position_embeddings=encoder_position_embeddings,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states),
                                       cache=cache if use_cache else None)


def _bool_mask(mask: torch.Tensor | None, batch: int, length: int, device, name: str) -> torch.Tensor:
    if mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=device)
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] != length:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)}, expected ({batch}, {length}): a 2-D padding mask over every "
            f"token the attention can see (for the decoder: the cached tokens plus the new ones)"
        )
    return mask.bool()


# ---------------------------------------------------------------------------------------------------- seq2seq LM
class Qwen3ForSeq2SeqLM(Qwen3PreTrainedModel, GenerationMixin):
    """Encoder + merged-attention decoder + LM head. The encoder's and decoder's input embeddings are always one
    matrix; the LM head joins them when `tie_word_embeddings` (as Qwen3-0.6B..4B checkpoints do)."""

    config: Qwen3EncoderDecoderConfig
    config_class = Qwen3EncoderDecoderConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    _no_split_modules = ["Qwen3DecoderLayer"]
    _can_record_outputs = None  # the encoder and decoder record their own
    # Every tie the model may hold (save_pretrained drops these duplicates); which hold is decided per config below.
    _tied_weights_keys = {"decoder.embed_tokens.weight": "encoder.embed_tokens.weight",
                          "lm_head.weight": "encoder.embed_tokens.weight"}

    def __init__(self, config: Qwen3EncoderDecoderConfig):
        super().__init__(config)
        self.encoder = Qwen3EncoderModel(config.encoder_config())
        self.decoder = Qwen3MergedDecoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict[str, str]:
        """Decoder input embeddings always follow the encoder's; the LM head too when the config ties them."""
        ties = {"decoder.embed_tokens.weight": "encoder.embed_tokens.weight"}
        if self.config.tie_word_embeddings:
            ties["lm_head.weight"] = "encoder.embed_tokens.weight"
        return ties

    def get_encoder(self, modality: str | None = None) -> Qwen3EncoderModel:
        return self.encoder

    def get_decoder(self) -> Qwen3MergedDecoder:
        return self.decoder

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.encoder.embed_tokens = value
        self.decoder.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """transformers resizes the input embeddings and the head; the decoder's input embeddings (always tied) are
        re-pointed at the new encoder matrix, and the config's vocabulary follows."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self.decoder.embed_tokens = self.encoder.embed_tokens
        self.encoder.config.vocab_size = self.decoder.config.vocab_size = self.config.vocab_size
        return embeddings

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """labels (B, T) -> decoder inputs (B, T): shifted right behind decoder_start_token_id, -100 -> pad."""
        start = self.config.decoder_start_token_id
        if start is None:
            raise ValueError("config.decoder_start_token_id is not set: pass decoder_start_token_id= to from_qwen3 "
                             "(or set it on the config) so labels can be shifted into decoder inputs")
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else start
        shifted = labels.new_full(labels.shape, start)
        shifted[:, 1:] = labels[:, :-1]
        return shifted.masked_fill(shifted == -100, pad)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        decoder_position_ids: torch.LongTensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: EncoderDecoderCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput:
        """input_ids (B, S) encoder tokens; decoder_input_ids (B, T) (or labels (B, T), shifted right into them)."""
        outputs = {"output_attentions": bool(output_attentions), "output_hidden_states": bool(output_hidden_states)}
        if encoder_outputs is None:
            encoder_outputs = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                                           inputs_embeds=inputs_embeds, **outputs)
        elif not isinstance(encoder_outputs, BaseModelOutput | BaseModelOutputWithPast):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        encoder_states = encoder_outputs.last_hidden_state  # (B, S, H)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids, inputs_embeds=decoder_inputs_embeds, attention_mask=decoder_attention_mask,
            position_ids=decoder_position_ids, encoder_hidden_states=encoder_states,
            encoder_attention_mask=attention_mask, cache=cache, use_cache=use_cache, **outputs,
        )
        logits = self.lm_head(slice_logits_to_keep(decoder_outputs.last_hidden_state, logits_to_keep))  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1).to(logits.device),
                                   ignore_index=-100)
        decoder_attentions = cross_attentions = None
        if decoder_outputs.get("attentions") is not None:
            encoder_len = encoder_states.shape[1]  # the merged weights split into their self and cross parts
            decoder_attentions = tuple(w[..., :-encoder_len] for w in decoder_outputs.attentions)
            cross_attentions = tuple(w[..., -encoder_len:] for w in decoder_outputs.attentions)
        output = Seq2SeqLMOutput(
            loss=loss, logits=logits, cache=decoder_outputs.cache,
            decoder_hidden_states=decoder_outputs.get("hidden_states"), decoder_attentions=decoder_attentions,
            cross_attentions=cross_attentions, encoder_last_hidden_state=encoder_states,
            encoder_hidden_states=encoder_outputs.get("hidden_states"),
            encoder_attentions=encoder_outputs.get("attentions"),
        )
        return output.to_tuple() if return_dict is False else output

    # ------------------------------------------------------------------------------------------------- building
    @classmethod
    def from_qwen3(
        cls,
        path: str | Path,
        *,
        encoder_key_rope: str = "none",
        encoder_layers: int | None = None,
        decoder_start_token_id: int | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
    ) -> "Qwen3ForSeq2SeqLM":
        """Encoder and decoder both from one decoder-only Qwen3 checkpoint (the T5Gemma recipe): the encoder gets
        its embeddings, first `encoder_layers` layers and final norm; the decoder all of it; the head its head."""
        base = load_decoder(path, dtype=dtype, device=device)
        if base.config.model_type != "qwen3":
            raise ValueError(f"from_qwen3 needs a dense Qwen3 checkpoint; {str(path)!r} is {base.config.model_type!r}")
        start = decoder_start_token_id
        if start is None:
            start = base.config.bos_token_id if base.config.bos_token_id is not None else base.config.eos_token_id
        if isinstance(start, list):
            start = start[0]
        if start is None:
            raise ValueError(f"{str(path)!r} names no bos/eos token: pass decoder_start_token_id= to from_qwen3")
        fields = {k: v for k, v in base.config.to_dict().items()
                  if k not in ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype")}
        config = Qwen3EncoderDecoderConfig(**fields, encoder_layers=encoder_layers, encoder_key_rope=encoder_key_rope,
                                           decoder_start_token_id=start)
        config._attn_implementation = "sdpa"
        with torch.device(base.device):
            model = cls(config).to(base.dtype)
        state = base.model.state_dict()
        encoder_state = {k: v for k, v in state.items() if not k.startswith("layers.")
                         or int(k.split(".")[1]) < config.encoder_layers}
        model.encoder.load_state_dict(encoder_state)
        model.decoder.load_state_dict(state)
        with torch.no_grad():
            model.lm_head.weight.copy_(base.lm_head.weight)
        model.tie_weights()
        return model.eval()
