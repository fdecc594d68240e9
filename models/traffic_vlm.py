"""The traffic-scene VLM: SigLIP's patch states as the memory of the classic cross-attention decoder.

`SiglipVisionModel` (transformers) turns a (B, 3, 224, 224) image into 196 patch states (patch 16, no CLS token);
those are the memory of a `Qwen3CrossAttentionForCausalLM` (`models/cross_attention.py`), whose shared
`memory_projection` maps the vision width to the decoder's. A question is `[BOS] words...`; its answer is read from
the LM head's `[YES]` and `[NO]` logits at the last real position (`yes_no_logits`, `classify`); other commands are
answered by `generate`. `withhold_image=True` zeroes the vision tokens (the "image withheld" control: with QK-norm
and bias-free projections, a zero memory makes every cross-attention read zero).

The vision tower is a tiny random SigLIP by default, or a local checkpoint directory (safetensors, never
`trust_remote_code`, never a download). The decoder defaults to the seed's small configuration.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import SiglipVisionConfig, SiglipVisionModel
from transformers.modeling_outputs import SequenceClassifierOutput

from models.cross_attention import Qwen3CrossAttentionConfig, Qwen3CrossAttentionForCausalLM

CONFIG_FILE = "traffic_vlm.json"


class TrafficVLM(nn.Module):
    """vision (SigLIP) -> patch states (B, N, vision width) -> cross-attention decoder; [YES]/[NO] from its head."""

    def __init__(self, vision: SiglipVisionModel, decoder: Qwen3CrossAttentionForCausalLM, *, yes_id: int,
                 no_id: int):
        super().__init__()
        self.vision = vision
        self.decoder = decoder
        self.yes_id, self.no_id = yes_id, no_id

    def vision_tokens(self, pixel_values: torch.Tensor, *, withhold_image: bool = False) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, N, vision width), N = (H / patch)^2; zeros when the image is withheld."""
        states = self.vision(pixel_values=pixel_values).last_hidden_state  # (B, N, Dv)
        return torch.zeros_like(states) if withhold_image else states

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                *, withhold_image: bool = False, **kwargs):
        """The decoder's CausalLMOutputWithPast over the question tokens, reading the image's vision tokens."""
        memory = self.vision_tokens(pixel_values, withhold_image=withhold_image)
        return self.decoder(input_ids=input_ids, attention_mask=attention_mask, memory=memory, **kwargs)

    def yes_no_logits(self, pixel_values: torch.Tensor, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, *, withhold_image: bool = False,
                      position_ids: torch.Tensor | None = None,
                      answer_positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, 2): the [YES] and [NO] logits at each row's last real token (left or right padding).

        A row may instead pack several questions about its image (`pack_questions`): `position_ids` (B, T) restart
        at 0 where each question starts, `attention_mask` is None (transformers' mask then keeps every question's
        attention within itself), and the logits are read at `answer_positions` (B, Q): (B, Q, 2). Each question's
        logits equal those of the question alone, and the image is encoded and cross-attended once for all."""
        memory = self.vision_tokens(pixel_values, withhold_image=withhold_image)
        if answer_positions is not None and attention_mask is not None:
            raise ValueError("packed questions are told apart by position_ids: pass attention_mask=None")
        hidden = self.decoder.model(input_ids=input_ids, attention_mask=attention_mask, memory=memory,
                                    position_ids=position_ids, use_cache=False).last_hidden_state  # (B, T, d)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        if answer_positions is None:
            final = hidden[rows, last_real_position(input_ids, attention_mask)]  # (B, d)
        else:
            final = hidden[rows[:, None], answer_positions]  # (B, Q, d)
        head = self.decoder.lm_head.weight[[self.yes_id, self.no_id]]  # (2, d)
        return final @ head.T  # (B, 2) or (B, Q, 2)

    @torch.no_grad()
    def classify(self, pixel_values: torch.Tensor, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, *, withhold_image: bool = False) -> torch.Tensor:
        """(B,) bool: True where [YES] outscores [NO]."""
        logits = self.yes_no_logits(pixel_values, input_ids, attention_mask, withhold_image=withhold_image)
        return logits[:, 0] > logits[:, 1]

    @torch.no_grad()
    def generate(self, pixel_values: torch.Tensor, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, *, withhold_image: bool = False, **generate_kwargs):
        """The decoder's `generate` (greedy/sample/beam) with the image's vision tokens as its memory."""
        memory = self.vision_tokens(pixel_values, withhold_image=withhold_image)
        return self.decoder.generate(input_ids=input_ids, attention_mask=attention_mask, memory=memory,
                                     **generate_kwargs)

    @torch.no_grad()
    def cross_attention_map(self, pixel_values: torch.Tensor, input_ids: torch.Tensor,
                            attention_mask: torch.Tensor | None = None, *, layer: int = -1) -> torch.Tensor:
        """(B, N): how one decoder layer's cross-attention spreads each row's last real token over the N patches,
        averaged over heads. SDPA never materialises the weights, so the layer's own input is captured by a hook and
        its q/k projections, QK-norm and scale are applied to it: softmax(q k^T * scaling), as SDPA computes it."""
        attention = self.decoder.model.layers[layer].cross_attn
        captured = {}
        hook = attention.register_forward_hook(lambda module, args, out: captured.update(h=args[0], m=args[1]))
        try:
            self.yes_no_logits(pixel_values, input_ids, attention_mask)
        finally:
            hook.remove()
        hidden, memory = captured["h"], captured["m"]  # (B, T, d) normed, (B, N, d) projected
        last = last_real_position(input_ids, attention_mask)  # (B,)
        rows = hidden[torch.arange(hidden.shape[0], device=hidden.device), last][:, None]  # (B, 1, d)
        query = attention.q_norm(attention.q_proj(rows).view(rows.shape[0], 1, -1, attention.head_dim))  # (B,1,H,hd)
        key, _ = attention.memory_keys_values(memory, None)  # (B, H_kv, N, hd)
        key = key.repeat_interleave(query.shape[2] // key.shape[1], dim=1)  # (B, H, N, hd): GQA groups
        scores = torch.einsum("bqhd,bhnd->bhn", query, key) * attention.scaling  # (B, H, N)
        return scores.softmax(-1).mean(1)  # (B, N)

    def save_pretrained(self, directory: str | Path) -> Path:
        """vision/ and decoder/ (transformers checkpoints, safetensors) and traffic_vlm.json ([YES]/[NO] ids)."""
        directory = Path(directory)
        self.vision.save_pretrained(directory / "vision", safe_serialization=True)
        self.decoder.save_pretrained(directory / "decoder", safe_serialization=True)
        (directory / CONFIG_FILE).write_text(json.dumps({"yes_id": self.yes_id, "no_id": self.no_id}))
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> "TrafficVLM":
        """What save_pretrained wrote, read back (safetensors only, never trust_remote_code, never a download)."""
        directory = Path(directory)
        if not (directory / CONFIG_FILE).is_file():
            raise FileNotFoundError(f"{directory} holds no {CONFIG_FILE}: pass a directory TrafficVLM.save_pretrained "
                                    f"wrote (a traffic_vlm job's export/)")
        ids = json.loads((directory / CONFIG_FILE).read_text())
        options = {"use_safetensors": True, "trust_remote_code": False, "local_files_only": True}
        vision = SiglipVisionModel.from_pretrained(directory / "vision", **options)
        decoder = Qwen3CrossAttentionForCausalLM.from_pretrained(directory / "decoder", **options)
        return cls(vision, decoder, yes_id=int(ids["yes_id"]), no_id=int(ids["no_id"]))


class YesNoObjective(nn.Module):
    """What the engine trains: the VLM, its loss the cross-entropy over the [YES]/[NO] logits (labels: 0 = YES,
    1 = NO)."""

    def __init__(self, vlm: TrafficVLM):
        super().__init__()
        self.vlm = vlm

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                answer_positions: torch.Tensor | None = None) -> SequenceClassifierOutput:
        """labels (B,) for one question a row, or (B, Q) for rows packing Q questions, each answered at its
        `answer_positions`."""
        logits = self.vlm.yes_no_logits(pixel_values, input_ids, attention_mask, position_ids=position_ids,
                                        answer_positions=answer_positions)  # (B, 2) or (B, Q, 2)
        return SequenceClassifierOutput(loss=F.cross_entropy(logits.reshape(-1, 2), labels.reshape(-1)),
                                        logits=logits)


def last_real_position(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B,) index of each row's last non-pad token: T-1 under left padding, length-1 under right padding."""
    if attention_mask is None:
        return torch.full((input_ids.shape[0],), input_ids.shape[1] - 1, device=input_ids.device)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)  # (T,)
    return (attention_mask.bool() * positions).argmax(-1)  # (B,)


def tiny_vision_config(*, image_size: int = 224, patch_size: int = 16, hidden_size: int = 128,
                       layers: int = 2, heads: int = 4) -> SiglipVisionConfig:
    """A small random SigLIP vision tower (no pooling head: the decoder reads every patch)."""
    return SiglipVisionConfig(image_size=image_size, patch_size=patch_size, hidden_size=hidden_size,
                              intermediate_size=4 * hidden_size, num_hidden_layers=layers, num_attention_heads=heads,
                              vision_use_head=False)


def decoder_config(*, memory_hidden_size: int, vocab_size: int = 500, hidden_size: int = 512,
                   intermediate_size: int = 2048, layers: int = 4, heads: int = 8, kv_heads: int = 2,
                   max_positions: int = 128, pad_token_id: int = 0, bos_token_id: int = 1,
                   eos_token_id: int = 2) -> Qwen3CrossAttentionConfig:
    """The seed's small decoder (vocab 500, hidden 512, 4 layers, 8 query / 2 KV heads of 64, 128 positions,
    RoPE 10000, RMSNorm 1e-6), tied embeddings, reading a memory of `memory_hidden_size`."""
    return Qwen3CrossAttentionConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads, max_position_embeddings=max_positions, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=True, memory_hidden_size=memory_hidden_size, pad_token_id=pad_token_id,
        bos_token_id=bos_token_id, eos_token_id=eos_token_id, use_sliding_window=False,
    )


def build_traffic_vlm(*, yes_id: int, no_id: int, vision_path: str | Path | None = None,
                      vision_config: SiglipVisionConfig | None = None, **decoder_kwargs) -> TrafficVLM:
    """A TrafficVLM: the vision tower from `vision_path` (a local SigLIP checkpoint; its vision part is used) or
    random from `vision_config` (default: `tiny_vision_config()`); a random decoder from `decoder_config(...)`."""
    if vision_path is not None:
        vision = SiglipVisionModel.from_pretrained(vision_path, use_safetensors=True, trust_remote_code=False,
                                                   local_files_only=True)
    else:
        vision = SiglipVisionModel(vision_config or tiny_vision_config())
    decoder = Qwen3CrossAttentionForCausalLM(
        decoder_config(memory_hidden_size=vision.config.hidden_size, **decoder_kwargs))
    return TrafficVLM(vision, decoder, yes_id=yes_id, no_id=no_id)
