"""Awareness models: Qwen3 decoders reading an encoder memory through gated cross-attention
(or, in `models/cross_attention.py`, a classic per-layer cross-attention decoder; `models/traffic_vlm.py` puts
it behind a SigLIP vision tower).

Imports torch and transformers only (no ray, deepspeed or mlflow), so it runs anywhere; each name loads its module
on first use.
"""

import importlib

_LAZY = {  # name -> the module defining it, imported on first use (PEP 562)
    "AwarenessConfig": "models.awareness",
    "AwarenessModel": "models.awareness",
    "AwarenessOutput": "models.awareness",
    "Qwen3CrossAttentionConfig": "models.cross_attention",
    "Qwen3CrossAttentionForCausalLM": "models.cross_attention",
    "StepFlops": "models.flops",
    "training_flops": "models.flops",
    "GatedCrossAttention": "models.gca",
    "GCAMemory": "models.gca",
    "MemoryKV": "models.gca",
    "MemoryPadding": "models.gca",
    "gca_parameter_count": "models.gca",
    "MemoryEncoder": "models.memory",
    "PAIRS": "models.specs",
    "PairSpec": "models.specs",
    "build_pair": "models.pairs",
    "get_pair": "models.specs",
    "write_random_checkpoints": "models.pairs",
    "UNPARTITIONED": "models.partitioning",
    "Partitioner": "models.partitioning",
    "resolve_gca_layers": "models.placement",
    "MemoryReading": "models.reading",
    "Qwen3EncoderDecoderConfig": "models.seq2seq",
    "Qwen3EncoderModel": "models.seq2seq",
    "Qwen3ForSeq2SeqLM": "models.seq2seq",
    "TrafficVLM": "models.traffic_vlm",
    "build_traffic_vlm": "models.traffic_vlm",
    "LoraPlan": "models.trainable",
    "LoraSettings": "models.trainable",
    "apply_lora": "models.trainable",
    "set_trainable": "models.trainable",
}


def __getattr__(name: str):
    """`from models import X` loads X's module only: a config or a CLI that needs a pair's name or a choice's
    spelling (models.specs) does not pay for transformers' model code."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "PAIRS",
    "UNPARTITIONED",
    "AwarenessConfig",
    "AwarenessModel",
    "AwarenessOutput",
    "GCAMemory",
    "GatedCrossAttention",
    "LoraPlan",
    "LoraSettings",
    "MemoryEncoder",
    "MemoryKV",
    "MemoryPadding",
    "MemoryReading",
    "PairSpec",
    "Partitioner",
    "Qwen3CrossAttentionConfig",
    "Qwen3CrossAttentionForCausalLM",
    "Qwen3EncoderDecoderConfig",
    "Qwen3EncoderModel",
    "Qwen3ForSeq2SeqLM",
    "StepFlops",
    "TrafficVLM",
    "apply_lora",
    "build_pair",
    "build_traffic_vlm",
    "gca_parameter_count",
    "get_pair",
    "resolve_gca_layers",
    "set_trainable",
    "training_flops",
    "write_random_checkpoints",
]
