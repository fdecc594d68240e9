"""What the models are, as plain data: the named pairs' architectures and the names of every choice a config makes
(fusion, train modes, LoRA targets, quantization). It imports neither torch nor transformers, so a config, `--help`
or a job's refusal of a bad flag needs none of the model code (models/__init__.py loads each name lazily)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal, get_args

# an export's files (AwarenessModel.save_pretrained): its config and the weights it adds to the base checkpoints
CONFIG_NAME = "awareness_config.json"
WEIGHTS_NAME = "awareness.safetensors"

# how the decoder reads the memory (models/fusion.py)
Fusion = Literal["gca", "cross", "merged"]
FUSIONS: tuple[str, ...] = get_args(Fusion)

# how a part of the pair trains (models/trainable.py)
TrainMode = Literal["frozen", "lora", "full"]
TRAIN_MODES: tuple[str, ...] = get_args(TrainMode)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# Qwen3-MoE holds all experts of a layer in one module as two 3-D parameters (E, 2I, H) and (E, H, I), not as
# nn.Linear modules, so module targets cannot reach them: the decoder target `experts` puts LoRA on both through
# PEFT's target_parameters (one rank-r pair per expert). The router (mlp.gate) is never targeted.
EXPERTS = "experts"
GROUP_TARGETS = {"decoder": ATTENTION + MLP + (EXPERTS,), "gca": ATTENTION + MLP, "encoder": ATTENTION + MLP}

# the frozen base's linears in fewer bits (models/quantization.py)
QUANTIZE = ("none", "nf4", "int8")

_QWEN3 = dict(
    model_type="qwen3", head_dim=128, rms_norm_eps=1e-6, rope_theta=1_000_000.0, hidden_act="silu",
    attention_bias=False, max_position_embeddings=40960, initializer_range=0.02,
)


def _qwen3(**overrides: Any) -> dict[str, Any]:
    return {**_QWEN3, "vocab_size": 151936, **overrides}


def _embedding(**overrides: Any) -> dict[str, Any]:
    return {**_QWEN3, "max_position_embeddings": 32768, "tie_word_embeddings": True, **overrides}


# Architecture hyper-parameters of the published checkpoints' config.json files.
QWEN3_0_6B = _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                    num_key_value_heads=8, tie_word_embeddings=True)
QWEN3_1_7B = _qwen3(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                    num_key_value_heads=8, tie_word_embeddings=True)
QWEN3_4B = _qwen3(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, tie_word_embeddings=True)
QWEN3_8B = _qwen3(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, tie_word_embeddings=False)
QWEN3_30B_A3B = _qwen3(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                       num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, num_experts=128,
                       num_experts_per_tok=8, decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[],
                       tie_word_embeddings=False)
QWEN3_EMBEDDING_0_6B = _embedding(vocab_size=151669, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                  num_attention_heads=16, num_key_value_heads=8)
QWEN3_EMBEDDING_4B = _embedding(vocab_size=151665, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                num_attention_heads=32, num_key_value_heads=8)
QWEN3_EMBEDDING_8B = _embedding(vocab_size=151665, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                num_attention_heads=32, num_key_value_heads=8)

# Random-weight pairs for tests and the embedded default. Like the real pairs, the encoder's vocabulary and width
# differ from the decoder's, so id validation and the projection are always exercised.
TINY_DECODER = _qwen3(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=True)
TINY_MOE_DECODER = _qwen3(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                          moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                          norm_topk_prob=True, mlp_only_layers=[], max_position_embeddings=1024,
                          tie_word_embeddings=False)
SMALL_DECODER = _qwen3(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
                       tie_word_embeddings=True)
SMALL_ENCODER = _embedding(vocab_size=496, hidden_size=192, intermediate_size=576, num_hidden_layers=4,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
# Like Qwen3-Embedding, which is built from a Qwen3 base, this encoder starts from its decoder: the same width,
# the decoder's embedding rows and first layers. In our needle runs it left the chance plateau thousands of steps
# sooner than an independently random encoder (the two embedding spaces start aligned).
TINY_SHARED_ENCODER = _embedding(vocab_size=496, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
# The tiny shapes with Qwen3's real vocabulary (decoder 151,936 rows, encoder 151,669): what stages 1-2 train on a
# laptop, since corpus shards hold real Qwen3 token ids.
TINY_TEXT_DECODER = {**TINY_DECODER, "vocab_size": 151936}
TINY_TEXT_ENCODER = {**TINY_SHARED_ENCODER, "vocab_size": 151669, "max_position_embeddings": 1024}  # 512-token chunks
TINY_ENCODER = _embedding(vocab_size=496, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=256)


@dataclass(frozen=True)
class PairSpec:
    """A decoder/encoder pair: the checkpoint directory names under a checkpoint root, and their architectures."""

    name: str
    decoder: str
    encoder: str
    decoder_config: dict[str, Any] = field(repr=False)
    encoder_config: dict[str, Any] = field(repr=False)
    published_params: tuple[str, str] | None = None  # (decoder, encoder) as the model cards state them, e.g. "8.2B"
    encoder_attention: str = "causal"  # Qwen3-Embedding was trained causally with last-token pooling
    random_weights: bool = False  # tiny pairs: checkpoints are written from a seed, never downloaded
    encoder_from_decoder: bool = False  # random pairs: the encoder starts as the decoder's embedding + first layers


PAIRS: dict[str, PairSpec] = {
    spec.name: spec
    for spec in (
        PairSpec("tiny", "tiny-qwen3", "tiny-qwen3-encoder", TINY_DECODER, TINY_ENCODER, random_weights=True),
        PairSpec("tiny-moe", "tiny-qwen3-moe", "tiny-qwen3-encoder", TINY_MOE_DECODER, TINY_ENCODER,
                 random_weights=True),
        PairSpec("tiny-shared", "tiny-qwen3", "tiny-qwen3-shared-encoder", TINY_DECODER, TINY_SHARED_ENCODER,
                 random_weights=True, encoder_from_decoder=True),
        PairSpec("tiny-text", "tiny-qwen3-text", "tiny-qwen3-text-encoder", TINY_TEXT_DECODER, TINY_TEXT_ENCODER,
                 random_weights=True, encoder_from_decoder=True),
        PairSpec("small", "small-qwen3", "small-qwen3-encoder", SMALL_DECODER, SMALL_ENCODER, random_weights=True),
        PairSpec("proto1", "Qwen3-0.6B", "Qwen3-Embedding-0.6B", QWEN3_0_6B, QWEN3_EMBEDDING_0_6B, ("0.6B", "0.6B")),
        PairSpec("proto2", "Qwen3-1.7B", "Qwen3-Embedding-0.6B", QWEN3_1_7B, QWEN3_EMBEDDING_0_6B, ("1.7B", "0.6B")),
        PairSpec("dev", "Qwen3-4B", "Qwen3-Embedding-4B", QWEN3_4B, QWEN3_EMBEDDING_4B, ("4.0B", "4B")),
        PairSpec("scale", "Qwen3-8B", "Qwen3-Embedding-8B", QWEN3_8B, QWEN3_EMBEDDING_8B, ("8.2B", "8B")),
        PairSpec("prod", "Qwen3-30B-A3B", "Qwen3-Embedding-8B", QWEN3_30B_A3B, QWEN3_EMBEDDING_8B, ("30.5B", "8B")),
    )
}


def get_pair(name: str) -> PairSpec:
    if name not in PAIRS:
        raise ValueError(f"unknown pair {name!r}; known pairs: {', '.join(PAIRS)}")
    return PAIRS[name]


def truncated_pair(name: str, layers: int) -> PairSpec:
    """A named pair with only the first `layers` layers on each side, everything else as it is."""
    spec = get_pair(name)
    if layers < 1:
        raise ValueError(f"layers must be at least 1, got {layers}")
    return replace(spec, name=f"{name}[{layers} layers]",
                   decoder_config={**spec.decoder_config, "num_hidden_layers": layers},
                   encoder_config={**spec.encoder_config, "num_hidden_layers": layers})
