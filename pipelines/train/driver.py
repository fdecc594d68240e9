"""The driver side of a stage job: resolve paths, open the MLflow run, build the TorchTrainer, fit, summarise."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchTrainer

from models import get_pair, write_random_checkpoints
from models.pairs import default_tiny_root
from pipelines.tracking.lineage import data_manifest_hash, git_commit, system_info
from pipelines.tracking.tracker import PARENT_RUN_TAG, Tracker, resolve_tracking_uri
from pipelines.train.config import StageConfig
from pipelines.train.engine import EXPORT_DIR
from pipelines.train.loop import train_loop_per_worker
from pipelines.train.plan import plan_for_stage
from pipelines.data.streams import data_config
from pipelines.train.streams import stage_datasets

RUN_ID_FILE = "mlflow_run_id"
CORPUS_METRICS = ("val_loss", "no_memory_val_loss", "token_accuracy", "no_memory_token_accuracy")
PENDING_FILE = "tracking_pending.json"  # what rank 0 could not log, handed to the driver to retry


def run_stage(config: StageConfig, *, fail_at: str | None = None, parent_run_id: str | None = None,
              tags: dict[str, str] | None = None, callbacks: list | None = None) -> dict[str, Any]:
    """Trains the stage on Ray Train and returns the job's summary. A rerun with the same run.name and
    run.storage_path resumes from its last checkpoint (and keeps logging into the same MLflow run).
    A sweep passes its MLflow `parent_run_id` (the run nests under it), extra `tags`, and Ray Train `callbacks`
    (Tune's report callback)."""
    config = prepare_paths(config.validate())
    check_memory_plan(config)
    run_dir = Path(config.run.storage_path) / config.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    tracking_uri = resolve_tracking_uri(config.tracking.tracking_uri)
    tracker = (open_run(config, tracking_uri, run_dir, parent_run_id=parent_run_id, tags=tags)
               if config.tracking.enabled else Tracker(None, None))
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    data = {}
    if config.data.train_path:  # corpus shards (stages 1-2, or stage 0 on built Q&A); else synthetic needles
        check_cpus_left_for_data(config)
        data = {"datasets": stage_datasets(config), "dataset_config": data_config()}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": config.to_dict(),
            "tracking_uri": tracking_uri,
            "mlflow_run_id": tracker.run_id,
            "fail_at": fail_at,
            "fault_marker": str(run_dir / f"injected-failure-{fail_at}") if fail_at else None,
            "tracking_pending": str(run_dir / PENDING_FILE),
        },
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.scaling.num_workers, use_gpu=config.scaling.use_gpu,
            resources_per_worker={"CPU": config.scaling.cpus_per_worker, **({"GPU": 1} if config.scaling.use_gpu else {})},
        ),
        run_config=ray.train.RunConfig(
            name=config.run.name,
            storage_path=config.run.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=config.run.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.run.keep_checkpoints),
            callbacks=callbacks,
        ),
        **data,
    )
    result = trainer.fit()
    tracker.adopt_pending(run_dir / PENDING_FILE)
    return summarise(config, result, tracker)


def check_memory_plan(config: StageConfig) -> None:
    """A GPU run that cannot fit is refused before any cluster time is spent, with the numbers."""
    if not config.scaling.use_gpu:
        return
    plan = plan_for_stage(config)
    if not plan.fits:
        raise ValueError(
            f"this run does not fit in GPU memory:\n{plan.table()}\nuse LoRA (model.decoder=lora), more workers, "
            f"gradient checkpointing, or deepspeed.offload_optimizer / offload_params"
        )


def check_cpus_left_for_data(config: StageConfig) -> None:
    """Ray Data's read tasks each ask for a whole CPU the training workers have not reserved, or the stream waits
    forever."""
    total = ray.cluster_resources().get("CPU", 0)
    reserved = config.scaling.num_workers * config.scaling.cpus_per_worker
    if total - reserved < 1:
        raise ValueError(
            f"the {config.scaling.num_workers} training workers reserve {reserved:g} of the cluster's {total:g} CPUs, "
            f"leaving less than the 1 CPU a Ray Data read task needs: lower scaling.cpus_per_worker (e.g. 0.5) or "
            f"add CPUs"
        )


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


def prepare_paths(config: StageConfig) -> StageConfig:
    """Absolute storage path; tiny pairs' random checkpoints written once here, before workers race to do it."""
    run = dataclasses.replace(config.run, storage_path=str(Path(config.run.storage_path).expanduser().resolve()))
    model = config.model
    spec = get_pair(model.pair)
    if spec.random_weights:
        root = Path(model.checkpoint_root or default_tiny_root()).expanduser().resolve()
        write_random_checkpoints(spec, root)
        model = dataclasses.replace(model, checkpoint_root=str(root))
    return dataclasses.replace(config, run=run, model=model)


def open_run(config: StageConfig, tracking_uri: str, run_dir: Path, *, parent_run_id: str | None = None,
             tags: dict[str, str] | None = None) -> Tracker:
    """A new MLflow run, or the one this run directory already logs to (a resumed run). Its tags carry the lineage
    a registered model needs: base checkpoints, data manifest hash, git commit, system info."""
    id_file = run_dir / RUN_ID_FILE
    existing = id_file.read_text().strip() if id_file.is_file() else None
    tracker = Tracker.start(tracking_uri, config.tracking.experiment, config.run.name, config.to_dict(),
                            run_tags(config, parent_run_id) | (tags or {}), run_id=existing)
    id_file.write_text(tracker.run_id or "")
    return tracker


def run_tags(config: StageConfig, parent_run_id: str | None) -> dict[str, str]:
    spec = get_pair(config.model.pair)
    root = config.model.checkpoint_root
    tags = {"stage": str(config.stage), "pair": config.model.pair, "decoder": spec.decoder, "encoder": spec.encoder,
            "base.decoder": str(Path(root) / spec.decoder) if root else spec.decoder,
            "base.encoder": str(Path(root) / spec.encoder) if root else spec.encoder,
            "data.manifest_hash": data_manifest_hash(config.data.train_path, dataclasses.asdict(config.needle)),
            "git.commit": git_commit(), **system_info()}
    if parent_run_id:
        tags[PARENT_RUN_TAG] = parent_run_id
    return tags


def summarise(config: StageConfig, result, tracker: Tracker) -> dict[str, Any]:
    metrics = result.metrics or {}
    checkpoint = result.checkpoint.path if result.checkpoint else None
    summary = {
        "job": f"stage{config.stage}",
        "pair": config.model.pair,
        "needle_accuracy": metrics.get("needle_accuracy"),
        "no_memory_accuracy": metrics.get("no_memory_accuracy"),
        "gate_abs_mean": metrics.get("gate_abs_mean"),
        "gate_abs_init": math.tanh(abs(config.model.gca_gate_init)),  # what the gates started at, to compare
        **({key: metrics.get(key) for key in CORPUS_METRICS} if config.data.train_path else {}),
        "steps": metrics.get("examples_seen", 0) // config.train.memories_per_step,
        "examples_seen": metrics.get("examples_seen"),
        "seconds_per_step": metrics.get("step_seconds_median"),
        "checkpoint": checkpoint,
        "export": f"{checkpoint}/{EXPORT_DIR}" if checkpoint else None,
        "mlflow_run_id": tracker.run_id,
        "error": repr(result.error) if result.error else None,
    }
    if checkpoint:
        tracker.log_artifacts(Path(checkpoint) / EXPORT_DIR, "export")
    tracker.log_dict(summary, "summary.json")
    log_evaluation_table(tracker, metrics)
    summary["tracking_unlogged"] = tracker.close("FAILED" if result.error else "FINISHED")
    return summary


def log_evaluation_table(tracker: Tracker, metrics: dict[str, Any]) -> None:
    """The final evaluation as a table on the run it evaluates: needle accuracy by depth of the fact in memory."""
    depths = sorted(k for k in metrics if k.startswith("needle_accuracy/depth_"))
    if depths:
        tracker.log_table({"depth_bin": [int(k.rsplit("_", 1)[1]) for k in depths],
                           "needle_accuracy": [float(metrics[k]) for k in depths]}, "eval/needle_by_depth.json")
