"""Stage 4, distillation, as one job: the corpus (the embedded default's, made here when data.train_path is unset),
the teacher (distill.teacher, or an in_context teacher trained here first and cached), the student trained with
alpha * KL + (1 - alpha) * CE through the one driver (the teacher's top-k computed once in the stage recipe's
`prepare`), and the same student with alpha 0 on the same data and steps, so the summary can compare the two.

Why the default corpus is one needle fact with noisy target digits (pipelines.data.synthetic_needles.noisy_copy_rows):
the teacher must be genuinely better than the student for distillation to teach anything. With its single memory
chunk in the prompt, the fact's digits sit at a fixed distance before each digit the teacher predicts, which a
decoder with RoPE learns in about a hundred steps (a fixed-offset attention); the GCA student reads position-free
memory keys and must find the digits by content, which takes it far longer (docs/jobs.md, "Stage 4"). The noise
makes each label one sample of a distribution the teacher knows whole, as real text has many valid continuations: the
KL hands the student that distribution at every target token, where the cross-entropy gives one draw.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

from models.pairs import default_tiny_root
from pipelines.corpora.shards import MANIFEST, write_corpus
from pipelines.data.synthetic_needles import noisy_copy_rows
from pipelines.tracking.tracker import Tracker, resolve_tracking_uri
from pipelines.train.configs.stage import StageConfig
from pipelines.train.driver import init_ray, run_stage
from pipelines.train.recipes import Job

ROLE_TAG = "stage4.role"  # teacher | student | baseline, on each of the job's MLflow runs


def run_stage4(job: Job, config: StageConfig) -> dict[str, Any]:
    """Corpus -> teacher -> student (alpha) -> baseline (alpha 0), each a run of the stage `job`; the student's summary
    with the comparison."""
    config = config.validate()
    init_ray(config.run.verbose)
    config = with_default_corpus(config)
    config, teacher = with_teacher(job, config)
    student = run_stage(job, config, tags={ROLE_TAG: "student"})
    baseline = None
    if config.distill.baseline and not student.get("error"):
        baseline = run_stage(job, baseline_config(config), tags={ROLE_TAG: "baseline",
                                                            "stage4.student_run_id": student["mlflow_run_id"] or ""})
    summary = compare(student, baseline, teacher)
    record_comparison(config, summary)
    return summary


def cache_root(config: StageConfig) -> Path:
    """Where the default's corpus and teacher are kept between runs: beside the tiny pairs' random checkpoints."""
    return Path(config.model.checkpoint_root or default_tiny_root()).expanduser().resolve()


def digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def with_default_corpus(config: StageConfig) -> StageConfig:
    """The embedded default's corpus (train and val splits of noisy_copy_rows, from needle.seed and needle.seed + 1),
    written once per settings under the cache root; a config that names its corpus is returned as it is."""
    if config.data.train_path:
        return config
    d, spec = config.distill, config.needle.spec()
    settings = {"needle": dataclasses.asdict(config.needle), "noise": d.label_noise, "train": d.train_rows,
                "val": d.val_rows}
    out = cache_root(config) / "stage4-corpus" / digest(settings)
    if not (out / MANIFEST).is_file():
        splits = {"train": noisy_copy_rows(spec, config.needle.seed, d.train_rows, d.label_noise),
                  "val": noisy_copy_rows(spec, config.needle.seed + 1, d.val_rows, d.label_noise)}
        write_corpus(out, splits, row_group_rows=256, stage=4, sources=["synthetic:noisy_copy"], settings=settings)
    data = dataclasses.replace(config.data, train_path=str(out / "train"), val_path=str(out / "val"))
    return dataclasses.replace(config, data=data)


def teacher_config(config: StageConfig) -> StageConfig:
    """The in_context baseline on the same corpus, pair and settings, for distill.teacher_steps steps."""
    return dataclasses.replace(
        config, stage=0, model=dataclasses.replace(config.model, memory="in_context"),
        train=dataclasses.replace(config.train, max_steps=config.distill.teacher_steps),
        run=dataclasses.replace(config.run, name=f"{config.run.name}-teacher"))


def with_teacher(job: Job, config: StageConfig) -> tuple[StageConfig, dict[str, Any]]:
    """distill.teacher as given, or an in_context teacher trained first: cached under the cache root by its config
    and corpus, so a rerun of the default reuses it (its export copied there with teacher.json: run id, val loss)."""
    if config.distill.teacher:
        return config, {"export": config.distill.teacher, "mlflow_run_id": None, "val_loss": None}
    teaching = teacher_config(config)
    key = {k: v for k, v in teaching.to_dict().items() if k not in ("run", "tracking", "scaling", "distill")}
    corpus = Path(config.data.train_path).resolve().parent / MANIFEST
    cached = cache_root(config) / "stage4-teachers" / digest([key, hashlib.sha256(corpus.read_bytes()).hexdigest()])
    if not (cached / "teacher.json").is_file():
        summary = run_stage(job, teaching, tags={ROLE_TAG: "teacher"})
        if summary.get("error") or not summary.get("export"):
            raise RuntimeError(f"the teacher's training failed: {summary.get('error')}")
        if cached.exists():
            shutil.rmtree(cached)
        shutil.copytree(summary["export"], cached / "export")
        info = {"mlflow_run_id": summary["mlflow_run_id"], "val_loss": summary.get("val_loss"),
                "token_accuracy": summary.get("token_accuracy"), "trained_export": summary["export"]}
        (cached / "teacher.json").write_text(json.dumps(info, indent=1))
    info = json.loads((cached / "teacher.json").read_text())
    distill = dataclasses.replace(config.distill, teacher=str(cached / "export"))
    return dataclasses.replace(config, distill=distill), {"export": str(cached / "export"), **info}


def baseline_config(config: StageConfig) -> StageConfig:
    """The same student, data, steps and seed, without the teacher's term (alpha 0: the teacher's tensors still ride
    in its batches, so its KL to the teacher is logged too)."""
    return dataclasses.replace(config, distill=dataclasses.replace(config.distill, alpha=0.0),
                               run=dataclasses.replace(config.run, name=f"{config.run.name}-baseline"))


def compare(student: dict[str, Any], baseline: dict[str, Any] | None, teacher: dict[str, Any]) -> dict[str, Any]:
    b = baseline or {}
    student_val, baseline_val = student.get("val_loss"), b.get("val_loss")
    fields = {
        "student_val_loss": student_val, "baseline_val_loss": baseline_val, "teacher_val_loss": teacher.get("val_loss"),
        "student_token_accuracy": student.get("token_accuracy"), "baseline_token_accuracy": b.get("token_accuracy"),
        "teacher_token_accuracy": teacher.get("token_accuracy"),
        "student_beats_baseline": (student_val < baseline_val) if None not in (student_val, baseline_val) else None,
        "baseline_kl_last": b.get("kl_last"), "baseline_run_id": b.get("mlflow_run_id"),
        "baseline_export": b.get("export"), "teacher_export": teacher["export"],
        "teacher_run_id": teacher.get("mlflow_run_id"),
    }
    error = student.get("error") or b.get("error")
    return {**student, "job": "stage4", **fields, "error": error}


def record_comparison(config: StageConfig, summary: dict[str, Any]) -> None:
    """The comparison on the student's MLflow run: the baseline's and teacher's val loss, the student-teacher gap,
    and the other runs' ids as tags."""
    if not config.tracking.enabled or not summary.get("mlflow_run_id"):
        return
    tracker = Tracker(resolve_tracking_uri(config.tracking.tracking_uri), summary["mlflow_run_id"])
    values = {"distill/baseline_val_loss": summary["baseline_val_loss"],
              "distill/teacher_val_loss": summary["teacher_val_loss"]}
    if summary["student_val_loss"] is not None and summary["teacher_val_loss"] is not None:
        values["distill/student_teacher_gap"] = summary["student_val_loss"] - summary["teacher_val_loss"]
    tracker.log_metrics({k: v for k, v in values.items() if v is not None}, summary["steps"])
    tracker.set_tags({f"stage4.{k}": v for k, v in summary.items()
                      if k in ("baseline_run_id", "teacher_run_id", "teacher_export") and v})
    summary["tracking_unlogged"] = (summary.get("tracking_unlogged") or []) + tracker.unlogged()
