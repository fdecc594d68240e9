"""Awareness models: Qwen3 decoders reading an encoder memory through gated cross-attention
(or, in `models/cross_attention.py`, a classic per-layer cross-attention decoder; `models/traffic_vlm.py` puts
it behind a SigLIP vision tower).

Imports torch and transformers only (no ray, deepspeed or mlflow), so it runs anywhere.
"""

from models.awareness import AwarenessConfig, AwarenessModel, AwarenessOutput
from models.cross_attention import Qwen3CrossAttentionConfig, Qwen3CrossAttentionForCausalLM
from models.flops import StepFlops, training_flops
from models.gca import GatedCrossAttention, GCAMemory, MemoryKV, MemoryPadding, gca_parameter_count
from models.memory import MemoryEncoder
from models.pairs import PAIRS, PairSpec, build_pair, get_pair, write_random_checkpoints
from models.partitioning import UNPARTITIONED, Partitioner
from models.placement import resolve_gca_layers
from models.reading import MemoryReading
from models.seq2seq import Qwen3EncoderDecoderConfig, Qwen3EncoderModel, Qwen3ForSeq2SeqLM
from models.traffic_vlm import TrafficVLM, build_traffic_vlm
from models.trainable import LoraPlan, LoraSettings, apply_lora, set_trainable

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
