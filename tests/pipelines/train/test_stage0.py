"""The stage-0 job through Ray Train + DeepSpeed ZeRO-3 on 2 CPU workers: runs, resumes, survives failures,
never resumes from an incomplete checkpoint, and exports an artifact that reloads without DeepSpeed."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models import AwarenessModel
from models.awareness import WEIGHTS_NAME
from pipelines.evaluate.in_training import score_needles
from pipelines.train.configs.common import DeepSpeedSettings, RunSettings, TrackingSettings, TrainConfig
from pipelines.train.configs.stage import ModelConfig, NeedleConfig, StageConfig
from pipelines.train.hooks import HOOK_ENV
from pipelines.train.presets import STAGE0
from tests.pipelines.train import faults

pytestmark = pytest.mark.ray  # every test here starts Ray

ROOT = Path(__file__).resolve().parents[3]
M = 8  # memories per step


def small_config(tmp_path: Path, checkpoint_root: Path, name: str, steps: int, **model) -> StageConfig:
    return StageConfig(
        model=ModelConfig(pair=model.pop("pair", "tiny"), checkpoint_root=str(checkpoint_root), decoder="full",
                          encoder="full", gca_layers="upper_half", **model),
        needle=NeedleConfig(facts=4, questions=4, val_memories=8),
        train=TrainConfig(max_steps=steps, memories_per_step=M, lr=2e-3, warmup_steps=2, log_every=1, eval_every=2,
                          checkpoint_every=2),
        run=RunSettings(name=name, storage_path=str(tmp_path / "ray"), max_failures=1),
        tracking=TrackingSettings(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"),
    )


def expected_checksum(steps: int) -> int:
    return sum(range(steps * M))  # every example index 0 .. steps*M-1 exactly once


def test_stage0_job_end_to_end(tmp_path, checkpoint_root):
    """The entry point as a user runs it, shortened: trains, evaluates, checkpoints, exports, logs to MLflow; and
    survives the harder failure on the way: a worker dies after writing its shard of checkpoint 4 but before it is
    reported, so that checkpoint is incomplete and the run restarts from checkpoint 2 (one run for both: start-up
    dominates; every failure mode, one run each, in test_a_failed_worker_restarts_from_the_last_complete_checkpoint).
    needle.base_until checks the base task before steps 1 and 2 (a random model stays below the bar) and the mixture
    starts at needle.base_steps, 3, in the state a resumed run reads; needle.mixture_steps 1 ends the run at step 4,
    short of train.max_steps 6."""
    plan, marker = tmp_path / "faults.json", tmp_path / "injected-failure-save:4"
    faults.plan(plan, STAGE0.run.name, "save:4", marker)
    env = os.environ | {HOOK_ENV: faults.HOOK, faults.PLAN_ENV: str(plan), "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "stage0.py"), "--train.max_steps", "6", "--train.eval_every", "2",
         "--train.checkpoint_every", "2", "--train.log_every", "2", "--needle.val_memories", "8",
         "--needle.base_steps", "3", "--needle.base_until", "0.9", "--needle.base_check_every", "1",
         "--needle.mixture_steps", "1",
         "--model.checkpoint_root", str(checkpoint_root), "--run.storage_path", str(tmp_path / "ray")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["error"] is None
    assert marker.is_file()  # it did fail, at the checkpoint of step 4
    state = json.loads((Path(summary["checkpoint"]) / "trainer_state.json").read_text())
    assert state["index_checksum"] == sum(range(4 * STAGE0.train.memories_per_step))  # no example twice or lost
    assert state["mixture_from"] == summary["mixture_from"] == 3 and state["decay"] == [3, 4]
    console = result.stdout.splitlines()
    assert "the mixture starts at step 3; the run ends at step 4" in console, console
    assert any(line.startswith("step 2/6  loss ") for line in console), console
    assert any(line.startswith("step 4/4  loss ") for line in console), console
    assert any(line.startswith("eval step 2  needle acc ") for line in console), console
    assert not any("TrainingReport(" in line or "{'loss'" in line for line in console + result.stderr.splitlines())
    assert "mlflow ui --backend-store-uri" in result.stderr  # the closing sentence
    for key in ("needle_accuracy", "no_memory_accuracy", "gate_abs_mean", "checkpoint", "mlflow_run_id"):
        assert summary[key] is not None, key
    assert (Path(summary["export"]) / "awareness_config.json").is_file()
    assert (tmp_path / "mlflow.db").is_file()  # MLflow's embedded default store, in the working directory
    from mlflow.tracking import MlflowClient

    run = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(summary["mlflow_run_id"])
    assert run.data.params["train.max_steps"] == "6" and "needle_accuracy" in run.data.metrics
    checks = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run.info.run_id,
                                                                                   "base_check_accuracy")
    assert {m.step for m in checks} == {1, 2} and all(m.value < 0.9 for m in checks)
    assert run.info.status == "FINISHED"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"gates.png", "needle_heatmap.png", "needle_heatmap.json"} <= artifacts, artifacts
    heatmap_path = client.download_artifacts(run.info.run_id, "needle_heatmap.json", str(tmp_path))
    heatmap = json.loads(Path(heatmap_path).read_text())
    assert len(heatmap["memory_tokens"]) == len(heatmap["accuracy_by_depth"][0]) == 4  # depth x memory size
    assert heatmap["memory_tokens"] == sorted(heatmap["memory_tokens"])
    assert all(0 <= a <= 1 for row in heatmap["accuracy_by_depth"] for a in row)


# ~185 s on the shared 2 cores (load ~3.5), most of it the evaluations of each trained task: make test-slow
@pytest.mark.slow
def test_stage0_trains_on_a_mixture_of_sizes_tasks_and_similar_facts(tmp_path, checkpoint_root, local_ray):
    """Issue 26's needle options through Ray Train and ZeRO-3: memories of 1x-4x drawn per micro-batch (both workers
    the same size), every RULER task in the mixture (rows padded to one count per memory), hard distractors on
    two-token keys; the evaluation reports each trained task, the hard distractors and the largest size."""
    from mlflow.tracking import MlflowClient

    from pipelines.train.recipes.jobs import train

    config = small_config(tmp_path, checkpoint_root, "mixture", steps=2)
    needle = dataclasses.replace(config.needle, memory_scale_max=4, hard_distractors=0.5, key_tokens=2,
                                 variants=["single:2", "multi_key", "multi_value", "multi_query", "variable_tracking"])
    summary = train(dataclasses.replace(config, needle=needle))
    assert summary["error"] is None and summary["steps"] == 2 and summary["needle_accuracy"] is not None
    metrics = MlflowClient(config.tracking.tracking_uri).get_run(summary["mlflow_run_id"]).data.metrics
    for name in ("needle_accuracy", "needle_accuracy/multi_value", "needle_accuracy/multi_query",
                 "needle_accuracy/variable_tracking", "needle_accuracy/hard", "needle_accuracy/4x",
                 "needle_accuracy/multi_key/4x"):
        assert 0 <= metrics[name] <= 1, name


# ~95 s; resume stays checked in `make test` by a worker failing mid-save (restarted from the last complete
# checkpoint, nothing seen twice or skipped) and in `make test-e2e` by the corpus stage (a second epoch resumed)
@pytest.mark.slow
def test_resume_continues_where_it_stopped(tmp_path, checkpoint_root, local_ray):
    from pipelines.train.recipes.jobs import train

    first = train(small_config(tmp_path, checkpoint_root, "resume", steps=4))
    assert first["steps"] == 4
    second = train(small_config(tmp_path, checkpoint_root, "resume", steps=8))  # same name: resumes
    assert second["steps"] == 8 and second["mlflow_run_id"] == first["mlflow_run_id"]
    state = json.loads((Path(second["checkpoint"]) / "trainer_state.json").read_text())
    assert state["index_checksum"] == expected_checksum(8)  # nothing seen twice, nothing skipped
    assert [row[0] for row in state["gate_history"]] == list(range(1, 9))  # log_every=1: probed every step


# In `make test-slow`; `make test` runs save:4, the harder case (an incomplete checkpoint), inside
# test_stage0_job_end_to_end
@pytest.mark.slow
@pytest.mark.parametrize("fail_at", ["train:3", "save:4"])
def test_a_failed_worker_restarts_from_the_last_complete_checkpoint(tmp_path, checkpoint_root, local_ray, fault_plan,
                                                                     fail_at):
    """train:3 dies between checkpoints; save:4 dies after writing its shard but before reporting, so checkpoint 4
    is incomplete and the run must restart from checkpoint 2."""
    from pipelines.train.recipes.jobs import train

    name = f"fail-{fail_at[:5]}"
    faults.plan(fault_plan, name, fail_at, tmp_path / "ray" / name / f"injected-failure-{fail_at}")
    summary = train(small_config(tmp_path, checkpoint_root, name, steps=6))
    assert summary["error"] is None and summary["steps"] == 6
    state = json.loads((Path(summary["checkpoint"]) / "trainer_state.json").read_text())
    assert state["index_checksum"] == expected_checksum(6)
    assert (tmp_path / "ray" / f"fail-{fail_at[:5]}" / f"injected-failure-{fail_at}").is_file()  # it did fail


@pytest.mark.slow
def test_plain_data_parallel_resumes_after_a_failure_bitwise(tmp_path, checkpoint_root, local_ray, fault_plan):
    """--deepspeed.zero_stage 0 (DeepSpeed's plain data parallel, the faster step for the tiny pair on CPU): one
    worker dies at step 3, the run restarts from checkpoint 2 and its export equals, bit for bit, that of a run
    that never failed, and both saw every example once."""
    def config_of(name: str) -> StageConfig:
        return dataclasses.replace(small_config(tmp_path, checkpoint_root, f"zero0-{name}", steps=4),
                                   deepspeed=DeepSpeedSettings(zero_stage=0))

    runs = faults.assert_resume_is_exact(config_of, fault_plan, tmp_path, steps=4)
    for summary in runs.values():
        state = json.loads((Path(summary["checkpoint"]) / "trainer_state.json").read_text())
        assert state["index_checksum"] == expected_checksum(4)


# ~50 s each, in make test-slow: make test reloads a ZeRO-3 export in test_zero3_trains_each_fusion...[cross] and
# scores exports, GCA and baselines, through the evaluate job
@pytest.mark.slow
@pytest.mark.parametrize("memory", ["gca", "in_context"])
def test_export_reloads_without_deepspeed(tmp_path, checkpoint_root, local_ray, memory):
    """Also for a baseline (the memory in the prompt; only the decoder trains, under ZeRO-3 with the unused GCA
    blocks frozen): its export names its system, and reloaded it scores what the run reported."""
    from pipelines.data.memory_modes import read_system, system_mode
    from pipelines.train.recipes.jobs import train

    config = small_config(tmp_path, checkpoint_root, f"export-{memory}", steps=4, memory=memory)
    if memory == "in_context":  # all 4 facts asked in one prompt would give the last by elimination (refused)
        config = dataclasses.replace(config, needle=dataclasses.replace(config.needle, questions_per_row=2))
    summary = train(config)
    assert summary["memory"] == memory
    system = read_system(summary["export"])
    assert system["memory"] == memory and system["needle"]["facts"] == config.needle.facts
    model = AwarenessModel.from_pretrained(summary["export"])
    scores = score_needles(model, config.needle.spec(), config.needle.seed + 1, list(range(8)),
                           mode=system_mode(system))
    from mlflow.tracking import MlflowClient

    history = MlflowClient(config.tracking.tracking_uri).get_metric_history(summary["mlflow_run_id"], "needle_val_loss")
    final = [m.value for m in history if m.step == 4]
    assert final and abs(scores.loss - final[0]) < 1e-4 * max(1.0, final[0])
    assert scores.accuracy == summary["needle_accuracy"]


@pytest.mark.slow  # make test-e2e trains cross fusion in test_zero3_trains_expert_lora_under_cross_fusion
@pytest.mark.parametrize("fusion", ["cross", "merged"])
def test_zero3_trains_each_fusion_and_its_export_reloads(tmp_path, checkpoint_root, local_ray, fusion):
    """--model.fusion cross / merged through Ray Train and ZeRO-3 (the added cross-attention created partitioned,
    merged training the decoder's own attention): the export, reloaded without DeepSpeed, scores what the run
    reported."""
    from pipelines.train.recipes.jobs import train

    config = small_config(tmp_path, checkpoint_root, f"fusion-{fusion}", steps=2, fusion=fusion)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, checkpoint_every=2))
    summary = train(config)
    assert summary["error"] is None and summary["steps"] == 2 and summary["fusion"] == fusion
    assert summary["gate_abs_mean"] is None and summary["gate_abs_init"] is None  # no gates to report
    model = AwarenessModel.from_pretrained(summary["export"])
    assert model.fusion == fusion and model.gca_layers == [0, 1, 2, 3]
    saved = load_file(Path(summary["export"]) / WEIGHTS_NAME)
    if fusion == "cross":  # o_proj started at 0 and trained
        assert saved["decoder.model.layers.0.cross_attention.o_proj.weight"].abs().sum() > 0
    scores = score_needles(model, config.needle.spec(), config.needle.seed + 1, list(range(8)))
    assert scores.accuracy == summary["needle_accuracy"]


@pytest.mark.slow  # ~35 s; test_zero3_trains_expert_lora_under_cross_fusion trains the MoE pair under ZeRO-3
def test_zero3_trains_the_moe_pair(tmp_path, checkpoint_root, local_ray):
    from pipelines.train.recipes.jobs import train

    summary = train(small_config(tmp_path, checkpoint_root, "moe", steps=2, pair="tiny-moe"))
    assert summary["error"] is None and summary["steps"] == 2


@pytest.mark.e2e
def test_zero3_trains_expert_lora_under_cross_fusion(tmp_path, checkpoint_root, local_ray):
    """One run for two things ZeRO-3 partitions: the expert adapters sit inside the sparse block, a ZeRO-3 leaf, so
    they are gathered with it, and cross fusion adds a cross-attention block to every layer, created partitioned.
    Both train (LoRA's B factors and the blocks' o_proj start at zero and are not after two steps), and the export,
    reloaded without DeepSpeed, holds them and scores what the run reported."""
    from pipelines.train.recipes.jobs import train

    config = small_config(tmp_path, checkpoint_root, "moe-lora-cross", steps=2, pair="tiny-moe", fusion="cross")
    config.model = dataclasses.replace(config.model, decoder="lora", encoder="frozen",
                                       lora_targets=["q_proj", "k_proj", "v_proj", "o_proj", "experts"])
    summary = train(config)
    assert summary["error"] is None and summary["steps"] == 2 and summary["fusion"] == "cross"
    assert summary["gate_abs_mean"] is None and summary["gate_abs_init"] is None  # no gates to report
    saved = load_file(Path(summary["export"]) / WEIGHTS_NAME)
    expert_b = {n: t for n, t in saved.items() if ".mlp.experts." in n and "lora_B" in n}
    assert len(expert_b) == 4 * 2 and all(t.abs().sum() > 0 for t in expert_b.values())
    cross = [n for n in saved if n.endswith(".cross_attention.o_proj.weight")]
    assert cross and all(saved[n].abs().sum() > 0 for n in cross)
    reloaded = AwarenessModel.from_pretrained(summary["export"]).eval()  # without DeepSpeed
    assert reloaded.fusion == "cross"
    assert all(torch.equal(reloaded.get_parameter(n), t) for n, t in expert_b.items())
    scores = score_needles(reloaded, config.needle.spec(), config.needle.seed + 1, list(range(8)))
    assert scores.accuracy == summary["needle_accuracy"]
