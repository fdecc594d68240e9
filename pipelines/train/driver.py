"""The driver side of every training job: the recipe's preparation, the MLflow run, the one TorchTrainer, fit,
the summary. The stage jobs, the UL2 job and the traffic VLM job differ only in their recipe
(pipelines.train.recipes)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import ray
import ray.train
from ray.train.torch import TorchTrainer

from pipelines.cli import ConfigError
from pipelines.tracking.checkpoints import EXPORT_DIR, UNAVERAGED_EXPORT_DIR, CheckpointRecorder
from pipelines.tracking.tracker import PARENT_RUN_TAG, Tracker, resolve_tracking_uri
from pipelines.train.configs.stage import StageConfig
from pipelines.train.configs.traffic import TrafficConfig
from pipelines.train.configs.ul2 import Ul2Config
from pipelines.train.console import Console, quiet
from pipelines.train.loop import train_loop_per_worker
from pipelines.train.recipes import Job, Prepared, Recipe

RUN_ID_FILE = "mlflow_run_id"
PENDING_FILE = "tracking_pending.json"  # what rank 0 could not log, handed to the driver to retry
CHECKPOINTS_PENDING_FILE = "tracking_pending_checkpoints.json"  # the same, from the checkpoint recorder
CONFIG_FILE = "job_config.json"  # the config a run directory was trained with; a resume must match it
# What a resumed run may change: how long it runs, how often it logs, evaluates and checkpoints, how many failures it
# survives, and what it prints. Anything else (model, data, optimizer, seed, workers, tracking) would make one run
# of two different jobs.
RESUMABLE_CHANGES = frozenset({
    "train.max_steps", "needle.mixture_steps", "train.log_every", "train.eval_every", "train.checkpoint_every",
    "run.max_failures", "run.keep_checkpoints", "run.export_every_checkpoint", "run.verbose", "data.verify_hashes",
    "scaling.gpus_per_node", "scaling.gpu_memory_gib",
    "run.storage_path", "run.name",  # the same directory, however it was spelt
})


def run_training_job(job: Job, config: StageConfig | Ul2Config | TrafficConfig, *, parent_run_id: str | None = None,
                     tags: dict[str, str] | None = None, callbacks: list | None = None) -> dict[str, Any]:
    """Trains one run of `job` (its Recipe and name) on Ray Train and returns the job's summary. The job is given,
    not looked up: the Jobs' runs call this (pipelines.train.recipes.jobs), so the driver does not import them. A
    rerun with the same run.name and run.storage_path resumes from its last checkpoint (and keeps logging into the
    same MLflow run).
    Every checkpoint's URI, step and validation metrics are recorded on the run as Ray Train persists it.
    A sweep passes its MLflow `parent_run_id` (the run nests under it), extra `tags`, and Ray Train `callbacks`
    (Tune's report callback)."""
    started = time.perf_counter()
    config = config.validate()  # a config error costs no cluster start
    recipe = job.recipe()
    check_resumable(config)
    quiet(config.run.verbose)
    init_ray(config.run.verbose)
    prepared, config_given = recipe.prepare(config), config
    config = prepared.config
    run_dir = run_directory(config)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(json.dumps(config_fields(config_given), indent=1, sort_keys=True))
    tracking_uri = resolve_tracking_uri(config.tracking.tracking_uri)
    tracker = (open_run(config, prepared, tracking_uri, run_dir, parent_run_id=parent_run_id, tags=tags)
               if config.tracking.enabled else Tracker(None, None))
    recorder = CheckpointRecorder(tracking_uri, tracker.run_id, run_dir / CHECKPOINTS_PENDING_FILE)
    with Console(config.train.max_steps) as console:
        trainer = build_trainer(recipe, prepared, tracking_uri, tracker.run_id, run_dir,
                                [console.callback, recorder, *(callbacks or [])])
        result = trainer.fit()
    tracker.adopt_pending(run_dir / PENDING_FILE)
    tracker.adopt_pending(run_dir / CHECKPOINTS_PENDING_FILE)
    return summarise(job.name(config), recipe, config, result, tracker, seconds=time.perf_counter() - started)


def run_directory(config) -> Path:
    """Where a run's checkpoints and records live; the same name and storage path is the same run."""
    return Path(config.run.storage_path).expanduser().resolve() / config.run.name


def config_fields(config) -> dict[str, Any]:
    """The config as flat `section.field` values (JSON types), as a run directory records it."""
    flat = {}
    for section, fields in json.loads(json.dumps(config.to_dict())).items():
        if isinstance(fields, dict):
            flat |= {f"{section}.{name}": value for name, value in fields.items()}
        else:
            flat[section] = fields
    return flat


def check_resumable(config) -> None:
    """A rerun with the run's name and storage path resumes it, so it must be the same job: a ConfigError naming
    each changed field, before any cluster starts, if it is not. Without this check a changed config would train on
    from (or return) the old run's checkpoint as if it were the new job's."""
    recorded_file = run_directory(config) / CONFIG_FILE
    if not recorded_file.is_file():
        return  # a new run (or one recorded before this check)
    recorded, given = json.loads(recorded_file.read_text()), config_fields(config)
    changed = [f"{key} {recorded[key]!r} -> {given[key]!r}" for key in sorted(recorded.keys() & given.keys())
               if key not in RESUMABLE_CHANGES and recorded[key] != given[key]]
    if changed:
        raise ConfigError(
            f"run.name {config.run.name!r} in {config.run.storage_path} resumes a run trained with another config "
            f"({'; '.join(changed)}): rerun with that run's config to resume it, or start a new run with another "
            f"--run.name (its config: {recorded_file})")


def init_ray(verbose: bool) -> None:
    """Joins $RAY_ADDRESS or starts a local instance; the workers' own output reaches this console only if verbose."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=verbose,
                 logging_level=logging.INFO if verbose else logging.WARNING)


def build_trainer(recipe: Recipe, prepared: Prepared, tracking_uri: str, run_id: str | None, run_dir: Path,
                  callbacks: list) -> TorchTrainer:
    """The one TorchTrainer: the recipe travels to the workers with the config; Ray Train restarts failed workers
    from the last complete checkpoint. Workers may run on other nodes: they learn this node's address, so a tracking
    server it names as loopback reaches them (pipelines.train.loop.worker_tracking_uri)."""
    config = prepared.config
    s = config.scaling
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config(recipe, prepared, tracking_uri, run_id, run_dir),
        scaling_config=ray.train.ScalingConfig(
            num_workers=s.num_workers, use_gpu=s.use_gpu,
            resources_per_worker={"CPU": s.cpus_per_worker, **({"GPU": 1} if s.use_gpu else {})},
        ),
        run_config=ray.train.RunConfig(
            name=config.run.name,
            storage_path=config.run.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=config.run.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.run.keep_checkpoints),
            callbacks=callbacks,
        ),
        datasets=prepared.datasets or None,
    )


def loop_config(recipe: Recipe, prepared: Prepared, tracking_uri: str, run_id: str | None,
                run_dir: Path) -> dict[str, Any]:
    """What every worker's loop gets: plain data only (Ray Train's controller unpickles it too)."""
    return {"recipe": recipe_reference(recipe), "config": prepared.config.to_dict(), "worker": prepared.worker,
            "tracking_uri": tracking_uri, "driver_ip": ray.util.get_node_ip_address(), "mlflow_run_id": run_id,
            "tracking_pending": str(run_dir / PENDING_FILE)}


def recipe_reference(recipe: Recipe) -> str:
    """The recipe as "module:Class", not the object: Ray Train's controller unpickles the loop config, and the object
    would make it import the recipe's module (torch, DeepSpeed, transformers: ~8 s on 2 cores) before any worker
    starts. Only the workers import it (pipelines.train.loop.recipe_from)."""
    cls = type(recipe)
    return f"{cls.__module__}:{cls.__qualname__}"


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


def open_run(config, prepared: Prepared, tracking_uri: str, run_dir: Path, *, parent_run_id: str | None = None,
             tags: dict[str, str] | None = None) -> Tracker:
    """A new MLflow run, or the one this run directory already logs to (a resumed run), tagged with the recipe's
    lineage."""
    id_file = run_dir / RUN_ID_FILE
    existing = id_file.read_text().strip() if id_file.is_file() else None
    run_tags = prepared.tags | ({PARENT_RUN_TAG: parent_run_id} if parent_run_id else {}) | (tags or {})
    tracker = Tracker.start(tracking_uri, config.tracking.experiment, config.run.name, config.to_dict(), run_tags,
                            run_id=existing)
    id_file.write_text(tracker.run_id or "")
    return tracker


def summarise(job: str, recipe: Recipe, config, result, tracker: Tracker, *,
              seconds: float | None = None) -> dict[str, Any]:
    """Every job's fields (its name; steps, timing, checkpoint, run, error) around the recipe's (what it learned,
    its exports)."""
    metrics = result.metrics or {}
    checkpoint = result.checkpoint.path if result.checkpoint else None
    export_dir = f"{checkpoint}/{EXPORT_DIR}" if checkpoint else None
    unaveraged = f"{checkpoint}/{UNAVERAGED_EXPORT_DIR}" if checkpoint and config.train.ema_decay else None
    summary = {
        "job": job,
        **recipe.summary(config, metrics, export_dir, tracker),
        "steps": metrics.get("examples_seen", 0) // config.train.memories_per_step,
        "seconds_per_step": metrics.get("step_seconds_median"),
        # data, Ray start, training and evaluation, up to the summary
        "seconds": round(seconds, 1) if seconds is not None else None,
        "checkpoint": checkpoint,
        **({"export_unaveraged": unaveraged} if unaveraged else {}),  # the last step's own weights (train.ema_decay)
        "mlflow_run_id": tracker.run_id,
        "error": repr(result.error) if result.error else None,
    }
    tracker.log_dict(summary, "summary.json")
    summary["tracking_unlogged"] = tracker.close("FAILED" if result.error else "FINISHED")
    return summary
