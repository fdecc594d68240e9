"""QLoRA and 8-bit optimizer states through the stage-0 job: Ray Train on 2 CPU workers, DeepSpeed ZeRO-2 and ZeRO-3
over a 4-bit base (bitsandbytes' CPU backend); the export reloads onto a 4-bit and an fp32 base; a run killed
mid-way and resumed with 8-bit AdamW ends bitwise where an uninterrupted one does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import bitsandbytes as bnb
import pytest
import torch
from safetensors.torch import load_file

from models import AwarenessModel
from models.awareness import WEIGHTS_NAME
from pipelines.cli import ConfigError
from pipelines.evaluate.in_training import score_needles
from pipelines.train.configs.common import DeepSpeedSettings, RunSettings, TrackingSettings, TrainConfig
from pipelines.train.configs.stage import ModelConfig, NeedleConfig, StageConfig
from pipelines.train.engine import build_optimizer, deepspeed_config
from tests.pipelines.train import faults

M = 8  # memories per step


def qlora_config(tmp_path: Path, checkpoint_root: Path, name: str, steps: int, zero_stage: int = 3,
                 optimizer: str = "adamw", quantize: str = "nf4") -> StageConfig:
    return StageConfig(
        model=ModelConfig(pair="tiny", checkpoint_root=str(checkpoint_root), decoder="lora", encoder="frozen",
                          gca_layers="upper_half", quantize=quantize),
        needle=NeedleConfig(facts=4, questions=4, val_memories=8),
        train=TrainConfig(max_steps=steps, memories_per_step=M, lr=2e-3, warmup_steps=2, log_every=1, eval_every=2,
                          checkpoint_every=2, optimizer=optimizer),
        deepspeed=DeepSpeedSettings(zero_stage=zero_stage),
        run=RunSettings(name=name, storage_path=str(tmp_path / "ray"), max_failures=1),
        tracking=TrackingSettings(enabled=False),
    )


@pytest.mark.parametrize(("model", "message"), [
    (dict(quantize="nf4", decoder="full"), "model.decoder full trains the decoder's own weights"),
    (dict(quantize="int8", encoder="full", decoder="lora"), "model.encoder full trains the encoder's own weights"),
    (dict(quantize="nf4", memory="none", decoder="frozen"), "model.memory none trains only the decoder"),
    (dict(quantize="fp4"), "model.quantize must be one of none, nf4, int8"),
])
def test_impossible_quantized_settings_are_refused_in_one_line(model, message):
    with pytest.raises(ConfigError, match=message) as refused:
        StageConfig(model=ModelConfig(**model)).validate()
    assert len(str(refused.value).splitlines()) == 2  # the heading and one line naming the problem and the fix


def test_8bit_adamw_is_the_client_optimizer_deepspeed_is_allowed_to_wrap(tmp_path, checkpoint_root):
    config = qlora_config(tmp_path, checkpoint_root, "config", steps=2, optimizer="adamw_8bit")
    assert deepspeed_config(config, 2)["zero_allow_untested_optimizer"] is True
    assert "zero_allow_untested_optimizer" not in deepspeed_config(dataclasses.replace(
        config, train=dataclasses.replace(config.train, optimizer="adamw")), 2)
    weight = torch.nn.Parameter(torch.randn(4096))
    optimizer = build_optimizer([{"params": [weight], "name": "gca"}], config.train)
    assert isinstance(optimizer, bnb.optim.AdamW8bit) and optimizer.param_groups[0]["name"] == "gca"
    weight.grad = torch.randn(4096)
    optimizer.step()
    assert optimizer.state[weight]["state1"].dtype == torch.uint8  # both moments in 8 bits
    with pytest.raises(ConfigError, match="train.optimizer must be one of adamw, adamw_8bit"):
        dataclasses.replace(config, train=dataclasses.replace(config.train, optimizer="sgd")).validate()


# ~225 s each at load ~10 on the shared 2 cores; ZeRO-3 (the 4-bit weights partitioned) in `make test-e2e`
@pytest.mark.ray
@pytest.mark.parametrize("zero_stage", [pytest.param(2, marks=pytest.mark.slow),
                                        pytest.param(3, marks=pytest.mark.e2e)])
def test_a_4bit_base_trains_under_zero_and_its_export_reloads_onto_4bit_and_fp32_bases(
        tmp_path, checkpoint_root, local_ray, zero_stage):
    """Two workers, the 4-bit weights replicated (ZeRO-2) or partitioned with the rest (ZeRO-3, in the compute dtype's
    container); the export holds only what trained and scores, reloaded onto a 4-bit base, what the run reported."""
    from pipelines.train.recipes.jobs import train

    config = qlora_config(tmp_path, checkpoint_root, f"qlora-zero{zero_stage}", steps=2, zero_stage=zero_stage)
    summary = train(config)
    assert summary["error"] is None and summary["steps"] == 2
    saved = load_file(Path(summary["export"]) / WEIGHTS_NAME)
    assert saved and all("lora_" in n or ".cross_attention." in n or n.startswith("memory_projection.") for n in saved)
    assert any("lora_B" in n and t.abs().sum() > 0 for n, t in saved.items())  # LoRA trained
    four_bit = AwarenessModel.from_pretrained(summary["export"], quantize="nf4").eval()
    assert isinstance(four_bit.decoder.model.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    scores = score_needles(four_bit, config.needle.spec(), config.needle.seed + 1, list(range(8)))
    assert scores.accuracy == summary["needle_accuracy"]
    full = AwarenessModel.from_pretrained(summary["export"]).eval()  # the same adapters on the fp32 base
    assert all(torch.equal(p, saved[n]) for n, p in full.named_parameters() if n in saved)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in full.modules())


@pytest.mark.slow
@pytest.mark.ray
def test_8bit_adamw_over_a_4bit_base_resumes_after_a_failure_bitwise(tmp_path, checkpoint_root, local_ray, fault_plan):
    """One worker dies at step 3; the run restarts from checkpoint 2 (engine shards with the 8-bit moments and their
    quantization constants) and its final export equals, bit for bit, that of a run that never failed."""
    faults.assert_resume_is_exact(
        lambda name: qlora_config(tmp_path, checkpoint_root, name, steps=4, zero_stage=2, optimizer="adamw_8bit"),
        fault_plan, tmp_path, steps=4)
