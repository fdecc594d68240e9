"""models.flops against torch's own FLOP counter: the analytic counts behind benchmarks/gpu_mfu.py's MFU.

FlopCounterMode counts every matmul and attention product the step runs, dense (all q² pairs of a causal
attention), so it is compared with training_flops(causal="full"); the causal halving ("required") is checked in
closed form. SDPA runs in its math backend here: the CPU flash kernel has no formula in FlopCounterMode.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from models import AwarenessModel, MemoryEncoder, build_pair
from models.flops import flop_counter, training_flops
from pipelines.train.configs.stage import ModelConfig
from pipelines.train.model import prepare_model

B, T, C, L = 2, 24, 3, 16  # decoder rows x tokens, memory chunks x chunk length


def counted(model: AwarenessModel, batch: dict) -> tuple[int, int]:
    """FlopCounterMode's forward and backward FLOPs of one training step."""
    with sdpa_kernel(SDPBackend.MATH):  # models.flops.flop_counter: FlopCounterMode plus the MoE experts' grouped_mm
        with flop_counter() as forward:
            loss = model(**batch, labels=batch["input_ids"]).loss
        with flop_counter() as backward:
            loss.backward()
    return forward.get_total_flops(), backward.get_total_flops()


def batch_for(model: AwarenessModel, memory: str = "encoded") -> dict:
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, model.decoder.config.vocab_size, (B, T), generator=g)}
    ids = torch.randint(0, model.memory_encoder.encoder.config.vocab_size, (B, C, L), generator=g)
    if memory == "encoded":
        batch["memory_input_ids"] = ids
    elif memory == "stored":
        with torch.no_grad():
            batch["memory_states"] = model.encode_memory(ids)[0]
    return batch


def assert_matches_counter(model: AwarenessModel, batch: dict) -> None:
    with torch.no_grad():
        for block in model.gca_blocks().values():
            block.gate.fill_(0.5)
    forward, backward = counted(model.train(), batch)
    # read off the modules (requires_grad, PEFT's layers): nothing is recorded on the config
    assert not hasattr(model.config, "lora") and not hasattr(model.config, "trainable")
    flops = training_flops(model, batch, causal="full")
    assert backward > 0
    # equal today; the tolerance leaves room for a torch that counts some non-matmul op
    assert flops.forward_total == pytest.approx(forward, rel=1e-3)
    # the loss recomputes each chunk's logits in backward (models/loss.py): hardware work, not model FLOPs
    assert flops.backward_total + flops.forward["lm_head"] == pytest.approx(backward, rel=1e-3)


@pytest.mark.parametrize(("settings", "memory"), [
    # the pipeline's configuration: decoder LoRA on every projection, GCA + projection in full, encoder frozen
    ({}, "encoded"),
    ({}, "stored"),  # memory states from a store: no encoder in the step
    ({}, "none"),  # the decoder alone: no GCA block runs
    ({"decoder": "frozen"}, "encoded"),  # backward only from the first GCA layer up
    ({"decoder": "full", "encoder": "full"}, "encoded"),
    ({"decoder": "frozen", "gca": "lora", "encoder": "lora"}, "encoded"),
    ({"lora_targets": ["q_proj", "v_proj"], "lora_rank": 4}, "encoded"),  # the first layer's attention needs no dK
])
def test_tiny_pair_step_matches_flop_counter(checkpoint_root, settings, memory):
    model = prepare_model(build_pair("tiny", checkpoint_root=checkpoint_root), ModelConfig(pair="tiny", **settings))
    assert_matches_counter(model, batch_for(model, memory))


def test_gca_mlp_identity_projection_and_odd_head_dim_match_flop_counter():
    """head_dim != hidden / heads (as in Qwen3-0.6B: 16 heads x 128 in width 1024), an encoder as wide as the
    decoder (no projection matmul, as proto1), bidirectional encoder attention and GCA MLPs."""
    torch.manual_seed(0)
    shape = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                 max_position_embeddings=256)
    decoder = Qwen3ForCausalLM(Qwen3Config(vocab_size=300, num_hidden_layers=3, tie_word_embeddings=False, **shape))
    encoder = Qwen3Model(Qwen3Config(vocab_size=280, num_hidden_layers=2, **shape))
    model = AwarenessModel(decoder, MemoryEncoder(encoder, attention="bidirectional"), "upper_half", gca_mlp=True)
    assert isinstance(model.memory_projection, torch.nn.Identity)
    assert_matches_counter(prepare_model(model, ModelConfig()), batch_for(model))


def test_flop_counter_counts_the_fused_kernels_as_the_math_backend(checkpoint_root):
    """models.flops.flop_counter (what benchmarks/gpu_mfu.py cross-checks a GPU step with) on the fused CPU flash
    kernel, which plain FlopCounterMode skips, and whose backward it counts without the score recomputation."""
    model = prepare_model(build_pair("tiny", checkpoint_root=checkpoint_root), ModelConfig(pair="tiny")).train()
    batch = batch_for(model)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), flop_counter() as counter:
        model(**batch, labels=batch["input_ids"]).loss.backward()
    ops = {str(op) for op in counter.get_flop_counts()["Global"]}
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward" in ops
    assert counter.get_total_flops() == sum(counted(model, batch))
    flops = training_flops(model, batch, causal="full")
    assert counter.get_total_flops() == pytest.approx(flops.total + flops.forward["lm_head"], rel=1e-3)  # recomputed


def test_causal_attention_counts_the_unmasked_pairs(checkpoint_root):
    """'required' drops the q(q-1)/2 masked pairs of each causal attention: in the decoder's 4 layers forward and
    backward (Q, K, V require grad: 2x forward) and in the frozen encoder's 2 layers forward only."""
    model = prepare_model(build_pair("tiny", checkpoint_root=checkpoint_root), ModelConfig(pair="tiny"))
    batch = batch_for(model)
    full, required = training_flops(model, batch, causal="full"), training_flops(model, batch)

    def masked(rows: int, cfg, q: int) -> float:  # both products (scores, weighted sum) over the masked pairs
        return 4.0 * rows * cfg.num_attention_heads * cfg.head_dim * q * (q - 1) / 2 * cfg.num_hidden_layers

    decoder, encoder = model.decoder.config, model.memory_encoder.encoder.config
    assert full.forward["decoder"] - required.forward["decoder"] == masked(B, decoder, T)
    assert full.backward["decoder"] - required.backward["decoder"] == 2 * masked(B, decoder, T)
    assert full.forward["encoder"] - required.forward["encoder"] == masked(B * C, encoder, L)
    assert full.backward["encoder"] == required.backward["encoder"] == 0
    assert full.forward["gca"] == required.forward["gca"]  # cross-attention has no mask


def test_proto1_forward_is_every_linear_weight_times_its_tokens_plus_attention():
    """The real proto1 shapes (meta, nothing allocated): the config-based count equals 2 x (each Linear's weight
    x the tokens it sees) over the modules actually built, LoRA adapters included, plus attention in closed form."""
    model = prepare_model(build_pair("proto1", device="meta", dtype=torch.bfloat16), ModelConfig(pair="proto1"))
    b, t, c, length = 4, 2048, 16, 512
    m = c * length
    batch = {"input_ids": torch.empty(b, t, device="meta"),
             "memory_input_ids": torch.empty(b, c, length, device="meta")}
    flops = training_flops(model, batch)

    def tokens(name: str) -> int:
        if name == "decoder.lm_head":
            return b * (t - 1)  # the loss reads no logits at each row's last position
        if name.startswith("memory_encoder."):
            return b * m
        if ".cross_attention.k_proj" in name or ".cross_attention.v_proj" in name:
            return b * m
        return b * t

    linear = sum(2 * mod.weight.numel() * tokens(name) for name, mod in model.named_modules()
                 if isinstance(mod, torch.nn.Linear))  # the LM head included (tied to the embedding)
    assert "decoder.lm_head" in dict(model.named_modules())
    d, e = model.decoder.config, model.memory_encoder.encoder.config
    attention = (4 * b * d.num_attention_heads * d.head_dim * t * (t + 1) / 2 * d.num_hidden_layers
                 + 4 * b * c * e.num_attention_heads * e.head_dim * length * (length + 1) / 2 * e.num_hidden_layers
                 + 4 * b * d.num_attention_heads * d.head_dim * t * m * len(model.gca_layers))
    assert flops.forward_total == pytest.approx(linear + attention, rel=1e-12)
    assert model.gca_layers == list(range(19, 28)) and d.head_dim * d.num_attention_heads != d.hidden_size


def test_a_reloaded_model_counts_as_the_model_it_was_saved_from(checkpoint_root, tmp_path):
    """The plan and modes travel in the saved config file and are read off the rebuilt modules again."""
    settings = ModelConfig(pair="tiny", decoder="frozen", gca="lora", encoder="lora", lora_rank=4)
    model = prepare_model(build_pair("tiny", checkpoint_root=checkpoint_root), settings)
    reloaded = AwarenessModel.from_pretrained(model.save_pretrained(tmp_path / "run"))
    batch = batch_for(model)
    assert training_flops(reloaded, batch) == training_flops(model, batch)
    assert training_flops(reloaded, batch) != training_flops(build_pair("tiny", checkpoint_root=checkpoint_root), batch)


def test_flop_counter_counts_grouped_kv_heads_as_repeated_ones():
    """GQA through a fused kernel (fewer key/value heads than query heads) counts as the kernel computes it: as if
    the kv heads were repeated. torch 2.11's own formula asserted on it, which stopped gpu_mfu.py on an H200."""
    g = torch.Generator().manual_seed(0)
    query = torch.randn(2, 8, 16, 32, generator=g, requires_grad=True)
    key, value = (torch.randn(2, 2, 24, 32, generator=g, requires_grad=True) for _ in range(2))
    totals = []
    for grouped in (True, False):
        k, v = (key, value) if grouped else (key.repeat_interleave(4, 1), value.repeat_interleave(4, 1))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), flop_counter() as counter:
            torch.nn.functional.scaled_dot_product_attention(query, k, v, enable_gqa=grouped).sum().backward()
        totals.append(counter.get_total_flops())
    # forward 2 products, backward 4 (the recomputed scores not counted): 6 * 2*B*H*Q*K*hd
    assert totals == [6 * 2 * 2 * 8 * 16 * 24 * 32] * 2


@pytest.mark.parametrize("settings", [
    {},  # LoRA on the attention projections; the experts and router frozen
    {"decoder": "full"},
])
def test_moe_pair_counts_the_active_experts(checkpoint_root, settings):
    """Qwen3-MoE: the router over every token and each token through its top-k experts, as FlopCounterMode sees
    transformers' grouped experts compute them. (Expert LoRA is left out: PEFT folds W + B·A at each read of the
    parametrized weight, and the counter sees the fold twice a forward where the model needs it once.)"""
    model = prepare_model(build_pair("tiny-moe", checkpoint_root=checkpoint_root),
                          ModelConfig(pair="tiny-moe", **settings))
    cfg = model.decoder.config
    assert cfg.num_experts > cfg.num_experts_per_tok  # some experts stay idle for each token
    assert_matches_counter(model, batch_for(model))


def test_labels_decide_the_lm_head_tokens(checkpoint_root):
    """Only labelled positions reach the LM head (models/loss.py): a prompt of IGNORE labels costs no logits."""
    model = prepare_model(build_pair("tiny", checkpoint_root=checkpoint_root), ModelConfig(pair="tiny"))
    batch = batch_for(model)
    labels = batch["input_ids"].clone()
    labels[:, :10] = -100  # a 10-token prompt: positions 0-8 predict prompt tokens, position 9 the first answer
    with_labels = training_flops(model, {**batch, "labels": labels})
    cfg = model.decoder.config
    lm_head = 2.0 * cfg.hidden_size * cfg.vocab_size
    assert with_labels.forward["lm_head"] == lm_head * B * (T - 10)
    assert training_flops(model, batch).forward["lm_head"] == lm_head * B * (T - 1)
