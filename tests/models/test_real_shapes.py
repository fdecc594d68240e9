"""Each named pair's real shapes (widths, heads, head_dim, vocabulary, experts) truncated to two layers take a
training step on the CPU with random weights, through the code benchmarks/gpu_mfu.py runs on a GPU: a shape the
GPU call would fail on fails here first."""

import pytest
import torch

from models import build_pair, training_flops
from models.pairs import get_pair
from pipelines.train.configs.stage import ModelConfig
from pipelines.train.model import prepare_model


@pytest.mark.slow  # the scale and prod pairs' real embeddings and experts: ~2-3 GiB of bf16 weights each
@pytest.mark.parametrize("pair", ["proto1", "scale", "prod"])
def test_two_layers_of_each_pairs_real_shapes_take_a_training_step(pair):
    model = build_pair(pair, random_init=True, layers=2, dtype=torch.bfloat16, gca_layers=[1])
    model = prepare_model(model, ModelConfig(pair=pair, gca_layers=[1])).train()
    model.set_gates(0.5)
    real = get_pair(pair).decoder_config
    assert model.decoder.config.hidden_size == real["hidden_size"] and len(model.decoder.model.layers) == 2
    assert getattr(model.decoder.config, "num_experts", 0) == real.get("num_experts", 0)
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, real["vocab_size"], (2, 16), generator=g),
             "memory_input_ids": torch.randint(0, 1000, (2, 2, 8), generator=g)}
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert torch.isfinite(loss) and loss.dtype == torch.float32
    trained = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(g is not None and torch.isfinite(g).all() for g in trained.values())
    assert any(".cross_attention." in n for n in trained) and any("lora_" in n for n in trained)
    assert training_flops(model, batch).total > 0  # MoE counted by its active experts
