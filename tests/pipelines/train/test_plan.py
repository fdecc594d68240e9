import pytest
import torch

from jobs.plan import main as plan_main
from pipelines.train.configs.common import ScalingSettings
from pipelines.train.configs.stage import ModelConfig, StageConfig
from pipelines.train.plan import (GIB, PlanInput, fused_loss_bytes, measured_peak_gib, plan_for_stage, plan_memory,
                                  uses_liger)


def test_prod_pair_with_lora_fits_two_h100_nodes():
    plan = plan_memory(PlanInput(pair="prod", nodes=2, gpus_per_node=8, lora_rank=64))
    assert plan.fits and 10 < plan.total_gib < 40
    assert abs(plan.params["decoder"] - 30.5e9) / 30.5e9 < 0.01
    # 48 layers x (q, k, v, o) LoRA at rank 64 over the 30B-A3B's attention shapes; its experts are fused weights
    assert plan.params["decoder LoRA"] == 48 * 64 * ((2048 + 4096) * 2 + (2048 + 512) * 2)


def test_expert_lora_is_one_pair_per_expert_and_needs_checkpointing_on_prod():
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    plain = plan_memory(PlanInput(pair="prod", nodes=2, gpus_per_node=8, lora_targets=attention))
    experts = plan_memory(PlanInput(pair="prod", nodes=2, gpus_per_node=8, lora_targets=attention + ("experts",)))
    e, h, i, r = 128, 2048, 768, 16  # the counts come from PEFT's adapters injected on the meta device
    assert experts.params["decoder LoRA"] - plain.params["decoder LoRA"] == 48 * (e * r * (h + 2 * i) + e * r * (i + h))
    # each forward builds W + B@A for a layer's experts (bf16); checkpointing keeps one copy and its gradient
    assert experts.rows["expert weights with LoRA folded in"] * GIB == 2 * 2 * e * (2 * i * h + h * i)
    assert "expert weights with LoRA folded in" not in plain.rows
    assert experts.fits and not plan_memory(PlanInput(pair="prod", nodes=2, gpus_per_node=8,
                                                      gradient_checkpointing=False,
                                                      lora_targets=attention + ("experts",))).fits
    with pytest.raises(ValueError, match="'experts' needs a Qwen3-MoE decoder"):
        plan_memory(PlanInput(pair="scale", lora_targets=attention + ("experts",)))


def test_full_fine_tune_of_scale_on_one_gpu_does_not_fit_and_agrees_with_deepspeed():
    plan = plan_memory(PlanInput(pair="scale", nodes=1, gpus_per_node=1, decoder="full", encoder="full"))
    assert not plan.fits
    model_states = sum(v for k, v in plan.rows.items() if k.startswith(("parameters", "gradients", "fp32")))
    assert plan.deepspeed_estimate_gib == pytest.approx(model_states, rel=0.15)  # 16 B vs DeepSpeed's 18 B/param


def test_offloading_moves_optimizer_states_to_cpu():
    on_gpu = plan_memory(PlanInput(pair="dev", gpus_per_node=8, decoder="full"))
    offloaded = plan_memory(PlanInput(pair="dev", gpus_per_node=8, decoder="full", offload_optimizer=True))
    assert offloaded.total_gib < on_gpu.total_gib and offloaded.cpu_gib_per_node > 0


def test_plan_job_exit_code(capsys):
    assert plan_main(["--pair", "prod", "--nodes", "2", "--gpus_per_node", "8"]) == 0
    assert plan_main(["--pair", "scale", "--gpus_per_node", "1", "--decoder", "full", "--encoder", "full"]) == 1
    assert '"fits": false' in capsys.readouterr().out


def test_stage_job_refuses_a_plan_that_cannot_fit():
    from pipelines.train.recipes.stage import check_memory_plan

    config = StageConfig(model=ModelConfig(pair="scale", decoder="full", encoder="full"),
                         scaling=ScalingSettings(num_workers=1, use_gpu=True, gpu_memory_gib=24))
    with pytest.raises(ValueError, match="(?s)does not fit in GPU memory.*does NOT fit"):
        check_memory_plan(config)


def test_load_peak_is_the_partitions_plus_one_gathered_module():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    plan = plan_memory(PlanInput(pair="prod", nodes=2, gpus_per_node=8))
    pair = sum(v for k, v in plan.params.items() if k != "decoder LoRA")  # LoRA is added after the build
    assert plan.load_rows["partitions of every parameter (bf16)"] * GIB == pytest.approx(2 * pair / 16)
    # transformers gathers one module's own parameters at a time; prod's largest is the 8B encoder's embedding,
    # just above a decoder layer's fused experts (128 x 3 x 768 x 2048)
    largest = 151665 * 4096
    assert plan.load_rows["one module gathered whole (largest)"] * GIB == 2 * largest
    # DeepSpeed's estimator with everything offloaded keeps only the largest layer's bf16 parameters and gradients
    # on a GPU; a load gathers the parameters alone
    _, gpu, _ = estimate_zero3_model_states_mem_needs(pair, largest, 8, 2, cpu_offload=True, cpu_offload_params=True)
    assert plan.load_rows["one module gathered whole (largest)"] * GIB == gpu / 2
    # only rank 0 reads values: it maps the larger checkpoint (the decoder, bf16) and stacks one MoE layer's experts
    assert plan.load_host_gib["node of rank 0 (mapped checkpoint shards)"] * GIB == 2 * plan.params["decoder"]
    assert plan.load_host_gib["node of rank 0 (one MoE layer's experts stacked)"] * GIB == 2 * 128 * 3 * 768 * 2048
    assert plan.fits and plan.peak_gib == plan.total_gib > plan.load_gib


def test_the_verdict_takes_the_larger_of_the_load_and_training_peaks():
    plan = plan_memory(PlanInput(pair="proto1", nodes=1, gpus_per_node=1, gpu_memory_gib=40, zero_stage=3))
    assert plan.fits and plan.zero_stage == 3
    plan.load_rows["one module gathered whole (largest)"] = 50.0  # a load that alone would not fit
    assert not plan.fits and plan.peak_gib == plan.load_gib
    assert "does NOT fit: peak" in plan.table()


def test_stage2_dry_run_of_prod_on_two_nodes_shows_the_load_peak_and_fits(tmp_path, capsys):
    from pipelines.train.job import run_job
    from pipelines.train.presets import STAGE2

    for split in ("train", "val"):
        (tmp_path / split).mkdir()
    with pytest.raises(SystemExit) as exit_:  # --dry-run prints and exits before any run
        run_job(["--model.pair", "prod", "--scaling.use_gpu", "true", "--scaling.num_workers", "16",
                 "--train.memories_per_step", "16", "--data.train_path", str(tmp_path / "train"),
                 "--data.val_path", str(tmp_path / "val"), "--dry-run"], STAGE2, "stage 2")
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "2 node(s) x 8 GPU(s) of 80 GiB" in out and "total while loading" in out
    assert "host memory while loading, node of rank 0" in out and "\nfits: peak" in out


def test_the_plan_keeps_a_pair_that_fits_whole_under_zero2_and_partitions_one_that_does_not():
    """No stage given: ZeRO-2 (nothing gathered at every step) where the whole bf16 pair, its partitioned training
    states and the activations fit each GPU; ZeRO-3 where they do not, or where parameters are offloaded."""
    whole = plan_memory(PlanInput(pair="scale", nodes=1, gpus_per_node=1))
    assert whole.zero_stage == 2 and whole.fits and "fits each GPU" in whole.table().splitlines()[0]
    pair = sum(whole.params.values())
    assert whole.rows["parameters (bf16, whole on each GPU)"] * GIB == pytest.approx(2 * pair)
    assert "gathered working set (2 largest layers)" not in whole.rows
    # below ZeRO-3 each rank builds the pair in host memory and DeepSpeed moves it: no GPU load phase of its own
    assert not whole.load_rows and whole.peak_gib == whole.total_gib and "loading: in host memory" in whole.table()
    assert whole.load_host_gib["every node (1 ranks, each the whole pair in bf16)"] * GIB == pytest.approx(
        2 * (pair - whole.params["decoder LoRA"]))
    partitioned = plan_memory(PlanInput(pair="prod", nodes=1, gpus_per_node=4))  # 30B-A3B + 8B: 76 GiB in bf16
    assert partitioned.zero_stage == 3 and "under ZeRO-2 the peak would be" in partitioned.zero_reason
    assert partitioned.rows["parameters (bf16, ZeRO-3 partitioned)"] * GIB == pytest.approx(
        2 * sum(partitioned.params.values()) / 4)
    assert plan_memory(PlanInput(pair="proto1", gpus_per_node=1, offload_params=True)).zero_stage == 3
    forced = plan_memory(PlanInput(pair="scale", nodes=1, gpus_per_node=1, zero_stage=3))
    assert forced.zero_stage == 3 and forced.zero_reason == "as configured"
    assert "gathered working set (2 largest layers)" in forced.rows  # on one GPU ZeRO-3 partitions nothing, and gathers


def test_the_logits_row_is_one_chunk_of_the_loss():
    """models/loss.py computes the LM head a chunk of tokens at a time: the row no longer grows with the batch."""
    from models.loss import CHUNK_TOKENS

    small, large = (plan_memory(PlanInput(pair="proto1", micro_batch=b, seq_len=2048)) for b in (1, 8))
    row = "logits and loss (one chunk, fp32 upcast)"
    assert small.rows[row] == large.rows[row] == 14 * CHUNK_TOKENS * 151936 / GIB


def test_a_run_with_ligers_fused_loss_is_planned_without_the_logits_chunk():
    # Liger's chunking by hand for 4,096 tokens, hidden 4,096, vocabulary 151,936: ceil(151936 / 4096) = 38 chunks'
    # worth, ceil(4096 / 38) = 108 tokens, rounded up to 128; bf16 logits of a chunk and the hidden states' gradient
    assert fused_loss_bytes(4096, 4096, 151936) == 2 * 128 * 151936 + 2 * 4096 * 4096
    plans = {fused: plan_memory(PlanInput(pair="scale", gpus_per_node=1, gpu_memory_gib=40.0, quantize="nf4",
                                          optimizer="adamw_8bit", fused_loss=fused)) for fused in (False, True)}
    chunk = plans[False].rows.pop("logits and loss (one chunk, fp32 upcast)")
    fused = plans[True].rows.pop("logits and loss (Liger's fused chunks)")
    assert chunk == pytest.approx(14 * 2048 * 151936 / GIB) and fused == pytest.approx(72450048 / GIB)
    slack = "allocator's cached slack (12% of the above)"
    assert plans[False].rows.pop(slack) - plans[True].rows.pop(slack) == pytest.approx(0.12 * (chunk - fused))
    assert plans[False].rows == plans[True].rows  # nothing else moves


def test_the_stage_jobs_plan_counts_the_loss_its_workers_use():
    gpu = ScalingSettings(num_workers=1, use_gpu=True, gpus_per_node=1)
    liger = StageConfig(model=ModelConfig(pair="proto1", liger=True), scaling=gpu)
    assert uses_liger(liger) and not uses_liger(StageConfig(model=ModelConfig(liger=None)))  # here: no CUDA
    assert "logits and loss (Liger's fused chunks)" in plan_for_stage(liger).rows


def test_the_measured_peak_is_the_allocators_peak_plus_what_the_device_holds_outside_it(monkeypatch):
    """What a GPU job reports beside the plan (gpu_peak_gib): counted as the GPU tests count their peaks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (100 * GIB, 140 * GIB))  # 40 GiB in use on the device
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 38 * GIB)  # so 2 GiB outside the allocator
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 45 * GIB)
    assert measured_peak_gib() == 47.0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert measured_peak_gib() is None
