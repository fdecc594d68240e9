"""Stage 4: the teacher's stored top-k joined to packed training rows by row id (positions line up with the labels, a
row the teacher skipped counts in the CE only), the recipe's loss hook (alpha 0 is today's loss, alpha 1 the KL),
config validation, a teacher export's run found beside it, and a few-step run through Ray Train whose summary has the
comparison's fields."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.data.memory_modes import SYSTEM_FILE
from pipelines.data.packing import PackingSpec, pack_examples
from pipelines.data.streams import CorpusStream
from pipelines.data.teacher_targets import TeacherEntries, read_scored
from pipelines.format.rows import IGNORE
from pipelines.format.shards import load_split
from pipelines.teachers.logits import TeacherLogitsConfig
from pipelines.train.configs.common import RunSettings, ScalingSettings, TrackingSettings, TrainConfig
from pipelines.train.configs.stage import ModelConfig, StageConfig
from pipelines.train.configs.stage4 import DistillConfig, Stage4Config
from pipelines.train.recipes import model_loss
from pipelines.train.recipes.stage4 import DISTILLATION, prepare_distillation, teacher_run_id
from tests.pipelines.format.test_shards import write_split
from tests.pipelines.teachers.test_logits import corpus_rows, run_in_process

ROOT = Path(__file__).resolve().parents[4]
K = 8
PACKING = PackingSpec(max_tokens=24, max_chunks=4, chunk_len=8)


def in_context_export(model, directory: Path, budget: int = 64) -> Path:
    export = model.save_pretrained(directory)
    (export / SYSTEM_FILE).write_text(json.dumps({"memory": "in_context", "context_budget": budget, "rag_k": 2,
                                                  "needle": None}))
    return export


@pytest.fixture
def scored(tmp_path, tiny):
    """A corpus split (11 rows, 4 row groups) and its teacher logits, some rows over the teacher's budget (skipped)."""
    split = write_split(tmp_path / "corpus", corpus_rows(11), files=2, row_group_rows=3)
    teacher = in_context_export(tiny, tmp_path / "teacher")
    config = TeacherLogitsConfig(teacher=str(teacher), split=str(split), k=K, max_tokens=24, batch_rows=4)
    manifest = run_in_process(config)
    stored = {i: row for name in manifest["shards"] for i, row in read_scored(config.out_dir() / name, K).items()}
    assert {row["skipped"] for row in stored.values()} == {"", "too_long"}  # both kinds present
    return split, config.out_dir(), stored


def first_batch(split: Path, logits: Path, rows: int = 11):
    stream = CorpusStream(load_split(split), PACKING, variants=None, memories_per_step=rows, grad_accum=1, rank=0,
                          world=1, start_step=0, teacher=TeacherEntries(logits, load_split(split), K))
    batch, count, checksum = stream.batch(0, 0)
    assert count == rows and checksum == sum(range(rows))
    return batch


def test_teacher_entries_line_up_with_the_packed_labels(scored):
    split, logits, stored = scored
    batch = first_batch(split, logits)
    rows = [{**row, "id": i} for i, row in enumerate(corpus_rows(11))]
    packed = pack_examples(rows, PACKING)  # how the stream packed them: first-fit in arrival order
    assert batch["teacher_ids"].shape == (*batch["labels"].shape, K)
    for r, row in enumerate(packed):
        offset = 0
        for example in row:
            n, entry = len(example["input_ids"]), stored[example["id"]]
            ids = batch["teacher_ids"][r, offset : offset + n]  # (n, k)
            labels = batch["labels"][r, offset : offset + n]
            if entry["skipped"]:  # counts in the CE only: its labels stay, it has no teacher entry
                assert (labels != IGNORE).any() and (ids == -1).all()
            else:
                targets = torch.nonzero(labels != IGNORE).flatten()
                assert targets[targets >= 1].tolist() == entry["positions"].tolist()
                assert torch.equal(ids[entry["positions"]], torch.as_tensor(entry["topk_ids"], dtype=torch.long))
                got = batch["teacher_logprobs"][r, offset : offset + n][entry["positions"]]
                assert torch.equal(got, torch.as_tensor(entry["topk_logprobs"].astype(np.float32)))
                prompt = torch.ones(n, dtype=torch.bool)
                prompt[entry["positions"]] = False
                assert (ids[prompt] == -1).all()
            offset += n
        assert (batch["teacher_ids"][r, offset:] == -1).all()  # padding


class Engine:
    """What the loss hook uses of a DeepSpeed engine: calling the module, and its device."""

    def __init__(self, model):
        self.model, self.device = model, torch.device("cpu")
        self.module = model

    def __call__(self, **batch):
        return self.model(**batch)


def stage4_config(alpha: float, **distill) -> Stage4Config:
    return Stage4Config(distill=DistillConfig(alpha=alpha, **{"k": K, **distill}))


def test_loss_hook_is_todays_loss_at_alpha_0_and_the_kl_at_alpha_1(scored, tiny):
    split, logits, _ = scored
    batch, engine = first_batch(split, logits), Engine(tiny)
    batch["memory_input_ids"] %= 496  # the fixture rows' ids run to 500; the tiny encoder has 496
    plain = {k: v for k, v in batch.items() if not k.startswith("teacher_")}
    today = model_loss(engine, plain)
    assert today.parts == {}
    ce_only = DISTILLATION.loss(engine, stage4_config(0.0), batch)
    torch.testing.assert_close(ce_only.total, today.total)
    torch.testing.assert_close(ce_only.parts["ce"], today.total.detach())
    kl_only = DISTILLATION.loss(engine, stage4_config(1.0), batch)
    assert kl_only.parts["kl"] > 0
    torch.testing.assert_close(kl_only.total, kl_only.parts["kl"])
    kl_only.total.backward()  # the KL trains the student
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tiny.parameters())


def test_a_routing_model_adds_and_logs_its_routing_loss(scored, checkpoint_root):
    """memory_top_k > 0 in training: today's loss hook and stage 4's add the weighted routing loss and log it as
    `routing_loss` (packed corpus rows: each token routes within its own example's chunks)."""
    from models import MemoryReading, build_pair

    split, logits, _ = scored
    torch.manual_seed(0)
    routed = build_pair("tiny", checkpoint_root=checkpoint_root,
                        reading=MemoryReading(top_k=1, routing_loss=0.5)).train()
    engine = Engine(routed)
    batch = first_batch(split, logits)
    batch["memory_input_ids"] %= 496
    plain = {k: v for k, v in batch.items() if not k.startswith("teacher_")}
    today = model_loss(engine, plain)
    assert set(today.parts) == {"routing_loss"} and today.parts["routing_loss"] > 0
    ce_only = DISTILLATION.loss(engine, stage4_config(0.0), batch)
    assert set(ce_only.parts) == {"kl", "ce", "routing_loss"}
    torch.testing.assert_close(ce_only.total, ce_only.parts["ce"] + 0.5 * ce_only.parts["routing_loss"])
    routed.reading = replace(routed.reading, routing_loss=0.0)  # weight 0: the loss is neither computed nor logged
    lm = model_loss(engine, plain)
    assert lm.parts == {}
    torch.testing.assert_close(today.total, lm.total + 0.5 * today.parts["routing_loss"])


def problems(config: StageConfig) -> str:
    return "\n".join(config.problems())


def test_stage4_config_errors_name_the_problem_and_the_fix(tmp_path, tiny):
    missing = problems(stage4_config(0.5))
    assert "distill.teacher is missing" in missing and "--distill.teacher_steps" in missing
    assert "not an export" in problems(stage4_config(0.5, teacher=str(tmp_path / "nowhere")))
    gca = tiny.save_pretrained(tmp_path / "gca")
    (gca / SYSTEM_FILE).write_text(json.dumps({"memory": "gca"}))
    assert "must read it in its prompt" in problems(stage4_config(0.5, teacher=str(gca)))
    teacher = in_context_export(tiny, tmp_path / "teacher")
    assert problems(stage4_config(0.5, teacher=str(teacher))) == ""
    for k in (4, 1000):
        wrong_k = stage4_config(0.5, teacher=str(teacher), k=k)
        assert "distill.k must be within 8-256 (32-64 intended" in problems(wrong_k)
    assert "distill.alpha must be within [0, 1]" in problems(stage4_config(1.5, teacher=str(teacher)))
    student = dataclasses.replace(stage4_config(0.5, teacher=str(teacher)), model=ModelConfig(memory="in_context"))
    assert "stage 4 trains a GCA student" in problems(student)


def test_logits_of_another_teacher_are_refused(tmp_path, tiny, scored):
    _, logits, _ = scored  # written by the fixture's teacher
    torch.manual_seed(1)
    for p in tiny.parameters():
        p.data.add_(torch.randn_like(p) * 0.01)
    other = in_context_export(tiny, tmp_path / "other")
    text = problems(stage4_config(0.5, teacher=str(other), logits=str(logits)))
    assert "holds the logits of another teacher" in text and "omit --distill.logits" in text
    same = problems(stage4_config(0.5, teacher=str(tmp_path / "teacher"), logits=str(logits)))
    assert same == ""
    assert "holds top-8 logits, and distill.k is 16" in problems(
        Stage4Config(distill=DistillConfig(teacher=str(tmp_path / "teacher"), logits=str(logits), k=16)))


def test_a_teacher_that_scored_no_row_stops_stage4_with_the_fix(tmp_path, tiny):
    """Every row over the teacher's context (too_long): stage 4 would distil nothing, so it says so and how."""
    split = write_split(tmp_path / "corpus", corpus_rows(5), files=1, row_group_rows=5)
    teacher = in_context_export(tiny, tmp_path / "teacher")
    config = TeacherLogitsConfig(teacher=str(teacher), split=str(split), k=K, max_tokens=2, batch_rows=4)
    assert run_in_process(config)["skipped"]["too_long"] == 5
    stage4 = dataclasses.replace(stage4_config(0.5, teacher=str(teacher), logits=str(config.out_dir())),
                                 data=dataclasses.replace(StageConfig().data, train_path=str(split)))
    with pytest.raises(ValueError, match=r"scored no target token .*5 too_long.*--model.context_budget"):
        prepare_distillation(stage4)


def test_a_teacher_exports_run_is_found_beside_it(tmp_path):
    export = tmp_path / "run" / "checkpoint_000004" / "export"
    export.mkdir(parents=True)
    assert teacher_run_id(str(export)) is None
    (tmp_path / "run" / "mlflow_run_id").write_text("abc123\n")  # a Ray Train run directory's record
    assert teacher_run_id(str(export)) == "abc123"
    cached = tmp_path / "cache" / "teacher" / "export"
    cached.mkdir(parents=True)
    (cached.parent / "teacher.json").write_text(json.dumps({"mlflow_run_id": "def456"}))  # stage 4's cached copy
    assert teacher_run_id(str(cached)) == "def456"


def few_steps(tmp_path: Path, checkpoint_root: Path) -> Stage4Config:
    """The default's task at a few steps: its corpus made here (small), a teacher trained first, student, baseline."""
    from pipelines.train.presets import STAGE4

    return dataclasses.replace(
        STAGE4,
        model=dataclasses.replace(STAGE4.model, checkpoint_root=str(checkpoint_root)),
        data=dataclasses.replace(STAGE4.data, val_examples=16),
        train=TrainConfig(max_steps=3, memories_per_step=8, lr=2e-3, warmup_steps=1, log_every=1, eval_every=3,
                          checkpoint_every=3),
        distill=dataclasses.replace(STAGE4.distill, teacher_steps=2, train_rows=64, val_rows=16),
        scaling=ScalingSettings(num_workers=1, cpus_per_worker=1),
        run=RunSettings(name="s4", storage_path=str(tmp_path / "ray"), export_every_checkpoint=False),
        tracking=TrackingSettings(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"),
    )


@pytest.mark.ray
@pytest.mark.slow  # four Ray Train runs and a Ray Data pass: 674 s on 2 cores at load average ~30 (other jobs)
def test_a_few_stage4_steps_summarise_the_comparison(tmp_path, checkpoint_root, local_ray):
    from mlflow.tracking import MlflowClient

    from pipelines.train.recipes.jobs import train

    summary = train(few_steps(tmp_path, checkpoint_root))
    assert summary["error"] is None and summary["steps"] == 3 and summary["job"] == "stage4"
    for key in ("kl_first", "kl_last", "student_val_loss", "baseline_val_loss", "teacher_val_loss", "ce_last"):
        assert np.isfinite(summary[key]), key
    assert summary["bytes_per_target_token"] == 32 * 6 and Path(summary["teacher_logits"]).is_dir()
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.tags["stage4.role"] == "student" and run.data.tags["teacher.run_id"] == summary["teacher_run_id"]
    assert run.data.tags["stage4.baseline_run_id"] == summary["baseline_run_id"]
    assert {"kl", "ce", "distill/baseline_val_loss"} <= set(run.data.metrics)
    assert len(client.get_metric_history(run.info.run_id, "kl")) == 3  # every step
    # a second run reuses the cached corpus, teacher and logits: no teacher run, the same logits manifest
    logits_manifest = (Path(summary["teacher_logits"]) / "manifest.json").read_text()
    config = few_steps(tmp_path, checkpoint_root)
    again = train(dataclasses.replace(config, distill=dataclasses.replace(config.distill, baseline=False),
                                           run=RunSettings(name="s4-again", storage_path=str(tmp_path / "ray"))))
    assert again["teacher_run_id"] == summary["teacher_run_id"] and again["error"] is None
    assert again["baseline_val_loss"] is None and again["student_beats_baseline"] is None
    assert (Path(summary["teacher_logits"]) / "manifest.json").read_text() == logits_manifest


@pytest.mark.ray
@pytest.mark.slow  # the full default: several minutes
def test_the_default_stage4_job_lowers_its_kl(tmp_path):
    """`python jobs/stage4.py` as a user runs it (its corpus and teacher cached in a fresh checkpoint root)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, str(ROOT / "jobs" / "stage4.py"),
                             "--run.storage_path", str(tmp_path / "ray"),
                             "--tracking.tracking_uri", f"sqlite:///{tmp_path / 'mlflow.db'}"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=1800)
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0 and summary["error"] is None, result.stderr[-3000:]
    assert summary["kl_last"] < summary["kl_first"]
    for key in ("student_val_loss", "baseline_val_loss", "teacher_val_loss", "mlflow_run_id", "export", "steps"):
        assert summary[key] is not None, key
