"""The model a stage trains, from its model config (pipelines/train/model.py) on the tiny pair: what trains per
group (a baseline trains only its decoder, whatever the config says of encoder and GCA), LoRA where asked, the
gates' start, the encoder's gradient scale and gradient checkpointing. Gate init against a loaded export:
tests/pipelines/train/configs/test_stage.py."""

from __future__ import annotations

import math

import pytest

from models.trainable import trainable_modes
from pipelines.train.configs.stage import ModelConfig
from pipelines.train.model import build_model


def config(checkpoint_root, **fields) -> ModelConfig:
    return ModelConfig(pair="tiny", checkpoint_root=str(checkpoint_root), gca_layers="upper_half", **fields)


def test_what_trains_follows_the_config(checkpoint_root):
    model = build_model(config(checkpoint_root, decoder="lora", encoder="full", gca="full", lora_rank=4,
                               lora_targets=["q_proj", "v_proj"]))
    assert trainable_modes(model) == {"decoder": "lora", "encoder": "full", "gca": "full"}
    adapters = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters()
                if "lora_" in n and p.requires_grad}
    assert adapters == {"q_proj", "v_proj"}  # only the targets got adapters
    ranks = {min(p.shape) for n, p in model.named_parameters() if n.startswith("decoder.") and "lora_" in n}
    assert ranks == {4}  # lora_rank


@pytest.mark.parametrize("memory", ["in_context", "rag", "none"])
def test_a_baseline_trains_only_its_decoder(checkpoint_root, memory):
    """A baseline never runs the encoder or GCA blocks: training them would only spend optimizer state."""
    model = build_model(config(checkpoint_root, memory=memory, decoder="full", encoder="full", gca="full"))
    assert trainable_modes(model) == {"decoder": "full", "encoder": "frozen", "gca": "frozen"}


def test_gates_encoder_scale_and_checkpointing(checkpoint_root):
    model = build_model(config(checkpoint_root, gca_gate_init=0.5, encoder_grad_scale=10.0,
                               gradient_checkpointing=True))
    assert all(math.isclose(v, math.tanh(0.5), abs_tol=1e-6) for v in model.gate_values().values())
    assert model.memory_encoder.grad_scale == 10.0
    assert model.decoder.is_gradient_checkpointing and model.memory_encoder.encoder.is_gradient_checkpointing
    cross = build_model(config(checkpoint_root, fusion="cross", gca_gate_init=0.5))  # cross has no gates to open
    assert cross.gate_values() == {} and not cross.decoder.is_gradient_checkpointing
