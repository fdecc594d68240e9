"""Stage 4, distillation: its Recipe (the stage recipe with the teacher's top-k in its batches, computed once in
`prepare`, and the loss alpha * KL + (1 - alpha) * CE) and its runs (`run_stage4`): the corpus (the embedded
default's, made here when data.train_path is unset), the teacher (distill.teacher, or an in_context teacher trained
here first and cached), the student, and the same student with alpha 0 on the same data and steps, so the summary can
compare the two.

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

import torch

from models.pairs import default_tiny_root
from pipelines.data.synthetic_needles import noisy_copy_rows
from pipelines.format.shards import MANIFEST, write_corpus
from pipelines.teachers.logits import TeacherLogitsConfig, compute_teacher_logits, logits_match
from pipelines.tracking.tracker import Tracker, resolve_tracking_uri
from pipelines.train.configs.stage import StageConfig
from pipelines.train.configs.stage4 import Stage4Config
from pipelines.train.distill import distillation_loss
from pipelines.train.driver import init_ray, run_training_job
from pipelines.train.recipes import Job, Loss, Prepared, routing_part
from pipelines.train.recipes.jobs import job_for
from pipelines.train.recipes.stage import StageRecipe

ROLE_TAG = "stage4.role"  # teacher | student | baseline, on each of the job's MLflow runs


class Stage4Recipe(StageRecipe):
    """Stage 4: the stage Recipe, its batches carrying the teacher's top-k (computed in `prepare`), its loss the
    distillation's, its summary the teacher's and the loss parts' fields."""

    def parse(self, data: dict[str, Any]) -> Stage4Config:
        return Stage4Config.from_dict(data)

    def prepare(self, config: Stage4Config) -> Prepared:
        prepared = super().prepare(config)
        worker, tags = prepare_distillation(prepared.config)
        return dataclasses.replace(prepared, worker=prepared.worker | worker, tags=prepared.tags | tags)

    def loss(self, engine, config: Stage4Config, batch: dict[str, torch.Tensor]) -> Loss:
        """alpha * KL + (1 - alpha) * CE (pipelines.train.distill) on the teacher's top-k in the batch, its kl and ce
        logged beside it."""
        batch = {k: v.to(engine.device) for k, v in batch.items()}
        ids, logprobs, labels = batch.pop("teacher_ids"), batch.pop("teacher_logprobs"), batch.pop("labels")
        out = engine(**batch)  # no labels: the CE is computed once, below
        d = config.distill
        parts = distillation_loss(out.logits, labels, ids, logprobs, d.alpha, d.temperature)  # logits (B, T, V)
        routing = routing_part(out)  # a routing model's own loss, which no teacher gives
        total = parts.total + engine.module.reading.routing_loss * out.routing_loss if routing else parts.total
        return Loss(total, {"kl": parts.kl.detach(), "ce": parts.ce.detach(), **routing})

    def summary(self, config: Stage4Config, metrics: dict[str, Any], export_dir: str | None,
                tracker: Tracker) -> dict[str, Any]:
        return super().summary(config, metrics, export_dir, tracker) | distill_summary(config, metrics)


DISTILLATION = Stage4Recipe()


# ---------------------------------------------------------------------------------------------- driver side
def teacher_logits_dir(config: Stage4Config) -> Path:
    """distill.logits, else CORPUS/teacher_logits beside the training split."""
    d = config.distill
    return Path(d.logits).resolve() if d.logits else Path(config.data.train_path).resolve().parent / "teacher_logits"


def prepare_distillation(config: Stage4Config) -> tuple[dict[str, Any], dict[str, str]]:
    """Stage 4: the teacher's top-k logits of the training split, computed once with Ray Data (pipelines.data.
    teacher_logits) and reused while they match the teacher, k and corpus; what the workers need to join them, and
    the teacher's lineage as tags."""
    d, directory = config.distill, teacher_logits_dir(config)
    if not logits_match(directory, d.teacher, d.k, config.data.train_path):
        if not d.logits and directory.exists():
            shutil.rmtree(directory)  # the default place holds another teacher's, k's or corpus's: replaced
        compute_teacher_logits(TeacherLogitsConfig(teacher=d.teacher, split=config.data.train_path, out=str(directory),
                                                   k=d.k, actors=d.actors, use_gpu=d.use_gpu))
    manifest = json.loads((directory / MANIFEST).read_text())
    if not manifest["target_tokens"]:  # distilling nothing would train the CE alone and call it stage 4
        skipped = ", ".join(f"{n} {reason}" for reason, n in manifest["skipped"].items() if n) or "none skipped"
        raise ValueError(f"the teacher scored no target token of {config.data.train_path} ({manifest['rows']} rows: "
                         f"{skipped}; {directory / MANIFEST}). too_long: its memory in the prompt, the prompt and the "
                         f"target exceed the teacher's context: train the teacher with a smaller "
                         f"--model.context_budget, or give it shorter rows")
    teacher = manifest["teacher"]
    tags = {"teacher.export": teacher["export"], "teacher.weights_sha256": teacher["weights_sha256"],
            "teacher.memory": teacher["system"].get("memory", ""), "teacher.logits": str(directory),
            "teacher.logits_target_tokens": str(manifest["target_tokens"]),
            **({"teacher.run_id": run_id} if (run_id := teacher_run_id(d.teacher)) else {})}
    return {"teacher_logits": str(directory)}, tags


def teacher_run_id(export: str) -> str | None:
    """The MLflow run that trained an export: its run directory's `mlflow_run_id` (export = RUN/checkpoint_N/export),
    or a `teacher.json` beside a cached copy (`with_teacher`)."""
    export = Path(export).resolve()
    for file, read in ((export.parent.parent / "mlflow_run_id", lambda f: f.read_text().strip()),
                       (export.parent / "teacher.json", lambda f: json.loads(f.read_text()).get("mlflow_run_id"))):
        if file.is_file():
            return read(file) or None
    return None


def distill_summary(config: Stage4Config, metrics: dict[str, Any]) -> dict[str, Any]:
    manifest = json.loads((teacher_logits_dir(config) / MANIFEST).read_text())
    return {"kl_first": metrics.get("kl_first"), "kl_last": metrics.get("kl"), "ce_first": metrics.get("ce_first"),
            "ce_last": metrics.get("ce"), "alpha": config.distill.alpha, "teacher": config.distill.teacher,
            "teacher_logits": str(teacher_logits_dir(config)), "k": manifest["k"],
            "bytes_per_target_token": manifest["bytes_per_target_token"],
            "bytes_on_disk_per_target_token": manifest["bytes_on_disk_per_target_token"]}


def run_stage4(job: Job, config: Stage4Config) -> dict[str, Any]:
    """Corpus -> teacher (a stage job's run) -> student (alpha) -> baseline (alpha 0), each a run of the stage 4 `job`;
    the student's summary with the comparison."""
    config = config.validate()
    init_ray(config.run.verbose)
    config = with_default_corpus(config)
    config, teacher = with_teacher(config)
    student = run_training_job(job, config, tags={ROLE_TAG: "student"})
    baseline = None
    if config.distill.baseline and not student.get("error"):
        tags = {ROLE_TAG: "baseline", "stage4.student_run_id": student["mlflow_run_id"] or ""}
        baseline = run_training_job(job, baseline_config(config), tags=tags)
    summary = compare(student, baseline, teacher)
    record_comparison(config, summary)
    return summary


def cache_root(config: Stage4Config) -> Path:
    """Where the default's corpus and teacher are kept between runs: beside the tiny pairs' random checkpoints."""
    return Path(config.model.checkpoint_root or default_tiny_root()).expanduser().resolve()


def digest(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def with_default_corpus(config: Stage4Config) -> Stage4Config:
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


def teacher_config(config: Stage4Config) -> StageConfig:
    """The in_context baseline on the same corpus, pair and settings, for distill.teacher_steps steps: a stage 0
    config, trained by the stage job."""
    return config.stage_config(
        stage=0, model=dataclasses.replace(config.model, memory="in_context"),
        train=dataclasses.replace(config.train, max_steps=config.distill.teacher_steps),
        run=dataclasses.replace(config.run, name=f"{config.run.name}-teacher"))


def with_teacher(config: Stage4Config) -> tuple[Stage4Config, dict[str, Any]]:
    """distill.teacher as given, or an in_context teacher trained first: cached under the cache root by its config
    and corpus, so a rerun of the default reuses it (its export copied there with teacher.json: run id, val loss)."""
    if config.distill.teacher:
        return config, {"export": config.distill.teacher, "mlflow_run_id": None, "val_loss": None}
    teaching = teacher_config(config)
    key = {k: v for k, v in teaching.to_dict().items() if k not in ("run", "tracking", "scaling")}
    corpus = Path(config.data.train_path).resolve().parent / MANIFEST
    cached = cache_root(config) / "stage4-teachers" / digest([key, hashlib.sha256(corpus.read_bytes()).hexdigest()])
    if not (cached / "teacher.json").is_file():
        summary = run_training_job(job_for(teaching), teaching, tags={ROLE_TAG: "teacher"})
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


def baseline_config(config: Stage4Config) -> Stage4Config:
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


def record_comparison(config: Stage4Config, summary: dict[str, Any]) -> None:
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
