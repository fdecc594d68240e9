"""The memory plan in fewer bits: NF4 / int8 base linears, 8-bit Adam moments, the quantized load, and the seed
hardware table docs/pairs.md shows."""

from pathlib import Path

import pytest

from jobs.plan import main as plan_main
from models import build_pair
from models.quantization import WEIGHT_BITS
from pipelines.train.plan import (GIB, OPTIMIZER_ROWS, PlanInput, parameter_row, plan_memory, seed_hardware_plans,
                                  seed_hardware_table)

ROOT = Path(__file__).resolve().parents[3]


def test_nf4_counts_the_base_linears_at_4_127_bits_and_the_rest_at_16():
    bf16 = plan_memory(PlanInput(pair="scale", gpus_per_node=1, zero_stage=3))
    nf4 = plan_memory(PlanInput(pair="scale", gpus_per_node=1, quantize="nf4", zero_stage=3))
    meta = build_pair("scale", device="meta")
    linears = sum(m.weight.numel() for base in (meta.decoder, meta.memory_encoder.encoder)
                  for n, m in base.named_modules() if type(m).__name__ == "Linear" and n != "lm_head"
                  and ".cross_attention." not in n)  # Qwen3-8B's head is untied: transformers keeps it 16-bit
    saved = linears * (2 - WEIGHT_BITS["nf4"] / 8)
    difference = bf16.rows[parameter_row("none", 3)] - nf4.rows[parameter_row("nf4", 3)]
    assert difference * GIB == pytest.approx(saved, rel=1e-6)
    working_set = "gathered working set (2 largest layers)"
    assert nf4.rows[working_set] < bf16.rows[working_set] / 2


def test_8bit_adam_halves_the_optimizer_states_and_a_quantized_load_is_whole_on_every_gpu():
    adamw = plan_memory(PlanInput(pair="dev", gpus_per_node=2, quantize="nf4", zero_stage=3))
    eight = plan_memory(PlanInput(pair="dev", gpus_per_node=2, quantize="nf4", optimizer="adamw_8bit", zero_stage=3))
    assert eight.rows[OPTIMIZER_ROWS["adamw_8bit"]] == pytest.approx(adamw.rows[OPTIMIZER_ROWS["adamw"]] / 2)
    whole = adamw.load_rows["the whole pair, base linears nf4 (every GPU)"]
    # not partitioned while loading: twice a partition of 2 GPUs (less LoRA, added after)
    assert whole == pytest.approx(2 * adamw.rows[parameter_row("nf4", 3)], rel=0.02)
    assert "loading (quantized load), per GPU" in adamw.table() and "zero.Init" not in adamw.table()


def test_the_seed_pairs_fit_their_seed_hardware_as_the_docs_say():
    plans = seed_hardware_plans()
    assert plans["scale"]["nf4"].fits and not plans["scale"]["bf16"].fits  # QLoRA puts scale on one 40 GB GPU
    # prod's experts are fused weights transformers leaves in 16 bits, and a quantized load is not partitioned:
    # two 24 GB GPUs hold it only with ZeRO-3's parameter offload
    assert not plans["prod"]["nf4"].fits and plans["prod"]["bf16, parameters offloaded"].fits
    assert seed_hardware_table() in (ROOT / "docs" / "pairs.md").read_text()


def test_plan_job_takes_bits_and_refuses_impossible_ones(capsys):
    assert plan_main(["--pair", "scale", "--gpus_per_node", "1", "--gpu_memory_gib", "40", "--quantize", "nf4",
                      "--optimizer", "adamw_8bit"]) == 0
    assert "fp32 master + 8-bit Adam moments" in capsys.readouterr().out
    assert PlanInput(quantize="nf4", decoder="full").problems() == [
        "quantize nf4 freezes the base weights: train them with lora, or quantize none"]
    assert PlanInput(optimizer="lion").problems()
