"""benchmarks/quantized_needles.py as its docstring shows it, on a tiny LoRA export (random weights: the answers are
noise, the bookkeeping is not): the stored base's accuracy is the evaluation's own score of the same probes, and a
4-bit base answers the same cells, its logits near the stored base's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from models import LoraPlan, LoraSettings, apply_lora, build_pair, set_trainable
from pipelines.evaluate.common import load_system
from pipelines.evaluate.needle import NeedleSuite, score_probe

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lora_export(checkpoint_root, tmp_path_factory) -> Path:
    """A tiny decoder-LoRA export, as a QLoRA run writes one."""
    model = build_pair("tiny-shared", checkpoint_root=checkpoint_root, gca_layers="upper_half")
    apply_lora(model, LoraPlan(decoder=LoraSettings(rank=4)))
    set_trainable(model, decoder="lora", encoder="frozen", gca="full")
    return model.save_pretrained(tmp_path_factory.mktemp("quantized") / "export")


def run_benchmark(*args: str) -> dict:
    """The benchmark as a process; its one-line JSON summary."""
    done = subprocess.run([sys.executable, "benchmarks/quantized_needles.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stored_base_summary(lora_export) -> dict:
    return run_benchmark("--model", str(lora_export), "--quantize", "nf4", "--variants", "single", "multi_key",
                         "--multipliers", "1", "--memories", "2")


def test_the_stored_base_scores_as_the_evaluation_and_nf4_answers_every_cell(lora_export, stored_base_summary):
    export, summary = lora_export, stored_base_summary
    assert set(summary["cells"]) == {"single@1x", "multi_key@1x"}
    system = load_system("none", str(export), {"memory": "gca", "needle": None})
    for variant in ("single", "multi_key"):
        rows = [row for index in range(2) for row in score_probe(system, variant, 1, NeedleSuite().seed, index)]
        cell = summary["cells"][f"{variant}@1x"]
        assert cell["accuracy"]["none"] == pytest.approx(sum(r["score"] for r in rows) / len(rows))
        assert 0.0 <= cell["accuracy"]["nf4"] <= 1.0 and 0.0 <= cell["changed"]["nf4"] <= 1.0
        assert 0.0 < cell["logits_max_abs_diff"]["nf4"] < 10.0  # 4 bits move the logits, a little
        assert 0.0 <= cell["same_top_token"]["nf4"] <= 1.0
    assert summary["max_accuracy_gap"]["nf4"] == max(abs(c["accuracy"]["nf4"] - c["accuracy"]["none"])
                                                     for c in summary["cells"].values())


def test_a_bf16_base_is_the_reference_when_asked(lora_export, stored_base_summary):
    """Only the reference changes: the nf4 model answers exactly as against the stored base, the bf16 reference's
    logits differ from the stored (fp32) base's, so the distance to them does too."""
    summary = run_benchmark("--model", str(lora_export), "--quantize", "nf4", "--base_dtype", "bfloat16",
                            "--variants", "single", "--multipliers", "1", "--memories", "2")
    assert summary["base_dtype"] == "bfloat16" and set(summary["cells"]) == {"single@1x"}
    bf16, stored = summary["cells"]["single@1x"], stored_base_summary["cells"]["single@1x"]
    assert bf16["accuracy"]["nf4"] == stored["accuracy"]["nf4"]
    assert 0.0 < bf16["logits_max_abs_diff"]["nf4"] != stored["logits_max_abs_diff"]["nf4"]
