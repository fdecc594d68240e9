"""Builds the model a stage trains from its model config: the pair, LoRA adapters, initial weights, what trains."""

from __future__ import annotations

from pathlib import Path

import torch

from models import (UNPARTITIONED, AwarenessModel, LoraPlan, LoraSettings, MemoryReading, Partitioner, apply_lora,
                    build_pair, set_trainable)
from models.awareness import WEIGHTS_NAME
from pipelines.train.configs.stage import ModelConfig


def build_model(cfg: ModelConfig, *, partitioner: Partitioner = UNPARTITIONED) -> AwarenessModel:
    """The pair, its LoRA adapters and what trains, all from the model config; partitioned as it is built under a
    ZeRO-3 `partitioner` (pipelines.train.engine.zero3_loading)."""
    reading = cfg.reading
    if cfg.memory != "gca" or cfg.fusion == "merged":  # the prompt, or the decoder's own softmax: nothing to route
        reading = MemoryReading()
    model = build_pair(cfg.pair, checkpoint_root=cfg.checkpoint_root, gca_layers=cfg.gca_layers,
                       encoder_attention=cfg.encoder_attention, gca_mlp=cfg.gca_mlp, fusion=cfg.fusion,
                       reading=reading, encoder_checkpoint=cfg.encoder_checkpoint, partitioner=partitioner,
                       **quantized_loading(cfg.quantize))
    return prepare_model(model, cfg, partitioner=partitioner)


def quantized_loading(quantize: str) -> dict:
    """build_pair's arguments for model.quantize: bitsandbytes quantizes as it loads, on the device it loads to, so
    a quantized base loads straight onto this worker's GPU (a whole bf16 copy never passes through it)."""
    if quantize == "none":
        return {}
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return {"quantize": quantize, "device": device}


def prepare_model(model: AwarenessModel, cfg: ModelConfig, *,
                  partitioner: Partitioner = UNPARTITIONED) -> AwarenessModel:
    """The training configuration on a built pair: LoRA adapters, initial added weights, what trains, the encoder's
    gradient scale and gradient checkpointing (benchmarks apply it to pairs built with random weights on a GPU).
    LoRA adapters are created whole (they are small); deepspeed.initialize partitions them with rank 0's values."""
    targets = tuple(cfg.lora_targets)
    # a baseline (model.memory in_context | rag | none) never runs the encoder or the GCA blocks: only the decoder
    # trains
    encoder, gca = (cfg.encoder, cfg.gca) if cfg.memory == "gca" else ("frozen", "frozen")
    plan = LoraPlan(
        decoder=(LoraSettings(rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=targets)
                 if cfg.decoder == "lora" else None),
        gca=LoraSettings(rank=cfg.gca_lora_rank) if gca == "lora" else None,
        encoder=LoraSettings(rank=cfg.encoder_lora_rank) if encoder == "lora" else None,
    )
    if plan.decoder or plan.gca or plan.encoder:
        apply_lora(model, plan)
    if cfg.gca_gate_init and cfg.fusion == "gca":  # cross and merged have no gates
        model.set_gates(cfg.gca_gate_init, partitioner=partitioner)
    if cfg.init_from:
        model.load_added_weights(Path(cfg.init_from) / WEIGHTS_NAME, partitioner=partitioner)
    set_trainable(model, decoder=cfg.decoder, encoder=encoder, gca=gca)
    model.memory_encoder.grad_scale = cfg.encoder_grad_scale
    model.routing_trains_summaries = cfg.memory_routing_grad
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()  # from_pretrained leaves the pair in eval mode, where no layer is checkpointed

