"""The memory encoder: a transformers Qwen3Model run over memory chunks, causal or bidirectional."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from transformers import Qwen3Model
from transformers.masking_utils import create_bidirectional_mask

EncoderAttention = Literal["causal", "bidirectional"]
ENCODER_ATTENTIONS = ("causal", "bidirectional")


class MemoryEncoder(nn.Module):
    """Encodes chunks (B, C, L) into memory states (B, C*L, encoder hidden) and their mask (B, C*L).

    Qwen3-Embedding was trained causally (last-token pooling), so `causal` keeps its states in distribution;
    `bidirectional` lets every token see its whole chunk (the seed plan's assumption, and what a UL2-trained
    encoder expects). Each chunk is encoded on its own: memory grows with chunks, not quadratically.
    """

    def __init__(self, encoder: Qwen3Model, attention: EncoderAttention = "causal", grad_scale: float = 1.0):
        super().__init__()
        if attention not in ENCODER_ATTENTIONS:
            raise ValueError(f"encoder_attention must be one of {ENCODER_ATTENTIONS}, got {attention!r}")
        self.encoder = encoder
        self.attention = attention
        self.grad_scale = grad_scale  # the plan's remedy for weak encoder gradients: scale what flows back into it

    @property
    def hidden_size(self) -> int:
        return self.encoder.config.hidden_size

    def validate(self, memory_input_ids: torch.Tensor) -> None:
        """Refuses ids outside the encoder's vocabulary and chunks longer than its positions, naming the fix."""
        config = self.encoder.config
        if memory_input_ids.shape[-1] > config.max_position_embeddings:
            raise ValueError(
                f"memory chunks of {memory_input_ids.shape[-1]} tokens exceed the encoder's "
                f"{config.max_position_embeddings} positions; split the memory into chunks of at most "
                f"{config.max_position_embeddings} tokens, shaped [batch, chunks, chunk_len]"
            )
        _check_vocabulary(memory_input_ids, config.vocab_size, "memory_input_ids", "encoder")

    def forward(self, memory_input_ids: torch.Tensor, memory_attention_mask: torch.Tensor | None = None):
        """memory_input_ids (B, C, L) or (B, L) -> states (B, C*L, H_enc) with padded positions zeroed,
        mask (B, C*L)."""
        if memory_input_ids.dim() == 2:
            memory_input_ids = memory_input_ids[:, None, :]  # (B, 1, L): one chunk
            if memory_attention_mask is not None:
                memory_attention_mask = memory_attention_mask[:, None, :]
        if memory_input_ids.dim() != 3:
            raise ValueError("memory_input_ids must be [batch, chunks, chunk_len], "
                             f"got shape {tuple(memory_input_ids.shape)}")
        self.validate(memory_input_ids)
        b, c, length = memory_input_ids.shape
        if memory_attention_mask is None:
            memory_attention_mask = torch.ones_like(memory_input_ids)
        if memory_attention_mask.shape != memory_input_ids.shape:
            raise ValueError(
                f"memory_attention_mask shape {tuple(memory_attention_mask.shape)} differs from memory_input_ids "
                f"shape {tuple(memory_input_ids.shape)}"
            )
        ids = memory_input_ids.reshape(b * c, length)  # (B*C, L)
        mask = memory_attention_mask.reshape(b * c, length).bool()  # (B*C, L)
        states = self._encode(ids, mask)  # (B*C, L, H_enc)
        states = states.masked_fill(~mask[..., None], 0.0)  # padding must never reach the keys, not even as NaN
        if self.grad_scale != 1.0 and states.requires_grad:
            states = _ScaleGradient.apply(states, self.grad_scale)
        return states.reshape(b, c * length, -1), mask.reshape(b, c * length)

    def _encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if not any(p.requires_grad for p in self.encoder.parameters()):
            with torch.no_grad():  # a frozen encoder only reads: no graph, no saved activations
                return self._encode_states(ids, mask)
        return self._encode_states(ids, mask)

    def _encode_states(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # use_cache=False: nothing decodes after the encoder, so its keys and values are never kept.
        # Positions count real tokens only, so left and right padding give the same states.
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B*C, L)
        embeds = self.encoder.embed_tokens(ids)
        if self.attention == "causal":
            out = self.encoder(inputs_embeds=embeds, attention_mask=mask.long(), position_ids=position_ids,
                               use_cache=False)
        else:
            full = create_bidirectional_mask(config=self.encoder.config, inputs_embeds=embeds,
                                             attention_mask=mask.long())
            # is_causal=False reaches SDPA through transformers' kwargs, so a skipped (None) mask stays bidirectional.
            out = self.encoder(
                inputs_embeds=embeds, attention_mask={"full_attention": full}, position_ids=position_ids,
                is_causal=False, use_cache=False,
            )
        return out.last_hidden_state


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; multiplies the gradient by `scale` on the way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _check_vocabulary(ids: torch.Tensor, vocab_size: int, name: str, side: str) -> None:
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{name} holds token id {high if high >= vocab_size else low}, outside the {side}'s vocabulary of "
            f"{vocab_size} ids (Qwen3 decoders have 151936 rows, Qwen3-Embedding 151669/151665, over the same "
            f"tokenizer): tokenize with the tokenizer both checkpoints share, and map or drop ids >= {vocab_size}"
        )
