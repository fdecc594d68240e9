"""The model a stage trains, from its model config (pipelines/train/model.py) on the tiny pair: what trains per
group (a baseline trains only its decoder, whatever the config says of encoder and GCA), LoRA where asked, the
gates' start, the encoder's gradient scale and gradient checkpointing. Gate init against a loaded export:
tests/pipelines/train/configs/test_stage.py."""

from __future__ import annotations

import math

import pytest
import torch

from models.trainable import trainable_modes
from pipelines.train.configs.stage import ModelConfig
from pipelines.train.model import build_model
from tests.conftest import random_ids
from tests.models.test_awareness import DEC_VOCAB, memory_batch


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
    assert model.decoder.is_activation_checkpointing and model.memory_encoder.encoder.is_activation_checkpointing
    cross = build_model(config(checkpoint_root, fusion="cross", gca_gate_init=0.5))  # cross has no gates to open
    assert cross.gate_values() == {} and not cross.decoder.is_activation_checkpointing


def test_checkpointing_keeps_fewer_activations_and_the_frozen_encoder_none(checkpoint_root):
    """As built for a stage job, with no .train() of its own (the job calls none): checkpointing must act, which in
    transformers needs training mode (from_pretrained leaves eval mode: the flag was on and nothing was checkpointed,
    proto1 ran out of an H100), and a frozen encoder must keep no graph (transformers' input-grad hook on its
    embeddings made the backward recompute and differentiate it for nothing). Same loss and gradients either way."""
    ids = random_ids(2, 24, vocab=DEC_VOCAB, seed=0)
    memory, mask = memory_batch(chunks=4, length=16)

    def run(checkpointing: bool) -> tuple[int, float, dict[str, torch.Tensor], bool]:
        torch.manual_seed(0)
        model = build_model(config(checkpoint_root, decoder="lora", encoder="frozen", gca_gate_init=0.5,
                                   gradient_checkpointing=checkpointing))
        saved = []
        states = model.memory_encoder(memory, mask)[0]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = model(input_ids=ids, labels=ids, memory_input_ids=memory, memory_attention_mask=mask).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        return sum(saved), float(loss.detach()), grads, states.requires_grad

    plain_bytes, plain_loss, plain_grads, _ = run(False)
    kept_bytes, kept_loss, kept_grads, encoder_graph = run(True)
    assert kept_bytes < plain_bytes / 2, (kept_bytes, plain_bytes)
    assert not encoder_graph
    assert kept_loss == pytest.approx(plain_loss, rel=1e-6)
    assert kept_grads.keys() == plain_grads.keys() and kept_grads
    assert not any(n.startswith("memory_encoder.encoder.") for n in kept_grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(kept_grads[name], grad, rtol=1e-4, atol=1e-6)
