"""Ray Tune sweeps over LoRA rank, GCA placement and learning rate; each trial is the stage job's Ray Train run.

Ray 2.60 runs Ray Train V2, where a TorchTrainer is not a Tune trainable: a function trainable (`train_trial`) runs
`run_training_job`, and a Train callback forwards the workers' evaluation reports to Tune, where ASHA stops weak
trials.
MLflow: one parent run per sweep, each trial's stage run nested under it (the stage job opens and fills that run
itself, fault-tolerantly, so Ray's MLflowLoggerCallback, which logs from the Tune driver without a retry queue and
would open a second run per trial, is not used). The best trial's artifact is registered
(`pipelines.tracking.registry`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import ray.tune
from mlflow.tracking import MlflowClient
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler
from ray.tune.search.basic_variant import BasicVariantGenerator

from models import PAIRS
from models.fusion import FUSIONS
from models.placement import resolve_gca_layers
from pipelines.serving.register import register_run
from pipelines.tracking.lineage import git_commit, system_info
from pipelines.tracking.tracker import Tracker, resolve_tracking_uri
from pipelines.train.configs.stage import StageConfig
from pipelines.train.driver import run_training_job
from pipelines.train.presets import sweep_base, vocab_problem
from pipelines.train.recipes.jobs import job_for
from pipelines.train.recipes.stage import prepare_paths
from pipelines.tune.report import format_table, plot_sweep

TRIAL_TAG = "tune.trial_id"
SWEEP_TAG = "sweep.run_id"
TRIAL_FINISHED = "trial_finished"  # the key of the report a trial makes once its run holds its export


@dataclass
class SweepConfig:
    """What a sweep searches and how it spends the cluster; the trials' own settings are a StageConfig."""

    name: str = "sweep"  # Tune experiment name; trials' Ray Train runs are <name>-<trial id>
    num_samples: int = 8  # trials drawn from the space below
    # the decoder's LoRA ranks to draw from; None: 8 16 32 64 for a LoRA decoder, and no rank searched for a decoder
    # trained in full or frozen (a baseline's recipe sweep: learning rate and the rest)
    lora_ranks: list[int] | None = None
    # None: upper_third, upper_half, every_k:4, last:4 and an explicit list (the middle and the last layer)
    placements: list[str] | None = None
    # how the decoder reads the memory (gca cross merged); None: the base config's model.fusion alone. Placement
    # applies to gca; cross and merged read in every layer whatever the trial's placement says
    fusions: list[str] | None = None
    # chunks each query reads (model.memory_top_k, e.g. 0 4 8; 0: the whole memory); None: the base config's alone.
    # Routing applies to gca and cross; merged trials read the whole memory whatever the trial's k
    memory_top_ks: list[int] | None = None
    lr_min: float = 1e-4  # learning rate, log-uniform in [lr_min, lr_max]
    lr_max: float = 3e-3  # (see lr_min)
    metric: str | None = None  # reported at every evaluation (train.eval_every); None: validation_metric(base)
    mode: str = "min"  # min or max: whether a lower metric is better
    grace_period: int = 2  # evaluations a trial gets before ASHA may stop it
    reduction_factor: int = 2  # ASHA keeps 1 in reduction_factor trials at each rung
    trial_cpus: float = 0.1  # the trial's own function; its Train workers reserve scaling.cpus_per_worker each
    max_concurrent: int = 0  # 0: as many as the cluster's CPUs (or GPUs) hold at once
    seed: int = 0  # the search's random state: the same seed draws the same trials
    registered_model: str | None = "awareness"  # None: do not register the best trial
    alias: str = "candidate"  # the alias the registered best trial gets

    def for_base(self, base: StageConfig) -> "SweepConfig":
        """This sweep with its metric resolved for the base config."""
        return dataclasses.replace(self, metric=self.metric or validation_metric(base))

    def problems(self, base: StageConfig) -> list[str]:
        p = []
        metric = self.metric or validation_metric(base)
        depth = PAIRS[base.model.pair].decoder_config["num_hidden_layers"] if base.model.pair in PAIRS else None
        for spec in self.placement_specs(base) if depth else []:
            try:
                resolve_gca_layers(spec, depth)
            except ValueError as error:
                p.append(f"sweep.placements: {error}")
        unknown = sorted(set(self.fusions or ()) - set(FUSIONS))
        if unknown or self.fusions == []:
            p.append(f"sweep.fusions must name some of {FUSIONS}, got {self.fusions}")
        if self.memory_top_ks == [] or any(k < 0 for k in self.memory_top_ks or ()):
            p.append(f"sweep.memory_top_ks must be integers >= 0 (0: the whole memory), got {self.memory_top_ks}")
        if self.num_samples <= 0:
            p.append(f"sweep.num_samples must be positive, got {self.num_samples}")
        if self.lora_ranks is not None and (not self.lora_ranks or any(r <= 0 for r in self.lora_ranks)):
            p.append(f"sweep.lora_ranks must be positive integers, got {self.lora_ranks}")
        if not 0 < self.lr_min <= self.lr_max:
            p.append(f"need 0 < sweep.lr_min <= sweep.lr_max, got {self.lr_min}, {self.lr_max}")
        if self.mode not in ("min", "max"):
            p.append(f"sweep.mode must be min or max, got {self.mode!r}")
        if self.lora_ranks and base.model.decoder != "lora":
            p.append(f"sweep.lora_ranks needs model.decoder=lora, the base config has {base.model.decoder!r}: leave "
                     f"sweep.lora_ranks out to sweep the rest with the decoder trained as the base says")
        evaluations = base.train.max_steps // base.train.eval_every
        if evaluations < 1:
            p.append(f"train.max_steps ({base.train.max_steps}) < train.eval_every ({base.train.eval_every}): "
                     f"trials would never report {metric}")
        if base.data.train_path and not base.data.val_path:
            p.append(f"trials on corpus shards report {metric} on data.val_path: pass --data.val_path DIR/val "
                     f"(jobs/build_corpus.py's held-out split)")
        if self.trial_cpus <= 0 or self.trial_cpus >= 1:
            p.append(f"sweep.trial_cpus must be a fraction in (0, 1) (a whole CPU per trial starves its own Train "
                     f"workers on small machines), got {self.trial_cpus}")
        return p

    def lora_rank_choices(self, base: StageConfig) -> list[int]:
        if self.lora_ranks:
            return list(self.lora_ranks)
        return [8, 16, 32, 64] if base.model.decoder == "lora" else [base.model.lora_rank]

    def fusion_choices(self, base: StageConfig) -> list[str]:
        return list(self.fusions) if self.fusions else [base.model.fusion]

    def memory_top_k_choices(self, base: StageConfig) -> list[int]:
        return list(self.memory_top_ks) if self.memory_top_ks else [base.model.reading.top_k]

    def placement_specs(self, base: StageConfig) -> list[str]:
        if self.placements:
            return list(self.placements)
        depth = PAIRS[base.model.pair].decoder_config["num_hidden_layers"]
        return ["upper_third", "upper_half", "every_k:4", "last:4", f"{depth // 2},{depth - 1}"]


def validation_metric(base: StageConfig) -> str:
    """What trials are ranked on: the corpus validation loss (pipelines.data.streams.evaluate_corpus) when they train on
    shards, else the needle validation loss."""
    return "val_loss" if base.data.train_path else "needle_val_loss"


def accuracy_metric(base: StageConfig) -> str:
    return "token_accuracy" if base.data.train_path else "needle_accuracy"


# ------------------------------------------------------------------------------------------------- the trial
def evaluation_report_callback(metric: str):
    """A TuneReportCallback that forwards only the workers' reports carrying the sweep metric (the evaluation steps):
    Tune requires the scheduler's metric in every result, and ASHA then counts evaluations. The class is defined in
    the trial, so Ray Train's controller receives it pickled by value and never imports this module (torch,
    DeepSpeed, transformers)."""

    class EvaluationReportCallback(TuneReportCallback):
        def after_report(self, run_context, metrics, checkpoint):
            if metrics and metric in metrics[0]:
                super().after_report(run_context, metrics, checkpoint)

    return EvaluationReportCallback()


def train_trial(trial: dict[str, Any]) -> None:
    """One Tune trial: the stage job's Ray Train run with this trial's fusion, rank, placement and learning rate."""
    trial_id = ray.tune.get_context().get_trial_id()
    config = trial_config(StageConfig.from_dict(trial["base"]), trial, trial["sweep_name"], trial_id)
    summary = run_training_job(job_for(config), config, parent_run_id=trial["parent_run_id"],
                               tags={TRIAL_TAG: trial_id, SWEEP_TAG: trial["parent_run_id"] or ""},
                               callbacks=[evaluation_report_callback(trial["metric"])])
    if summary["error"]:
        raise RuntimeError(f"trial {trial_id}: the stage run failed: {summary['error']}")
    # The trial's last word, once its run holds its export: ASHA stops trials asynchronously, so a stop decided at a
    # rung can land after the last evaluation but before the export is logged, and only this report says it did not.
    kept = (trial["metric"], accuracy_metric(config), "no_memory_val_loss", "examples_seen")
    ray.tune.report({key: summary.get(key) for key in kept} | {"checkpoint_path": summary["checkpoint"],
                                                                TRIAL_FINISHED: True})


def trial_config(base: StageConfig, params: dict[str, Any], sweep_name: str, trial_id: str) -> StageConfig:
    fusion = str(params.get("fusion", base.model.fusion))
    top_k = 0 if fusion == "merged" else int(params.get("memory_top_k", base.model.reading.top_k))  # gca, cross only
    # without routing (k = 0, or merged) its companions mean nothing: their off values, so the trial validates
    routing_grad = base.model.memory_routing_grad and bool(top_k)
    model = dataclasses.replace(base.model, lora_rank=int(params["lora_rank"]), gca_layers=str(params["gca_layers"]),
                                fusion=fusion, reading=base.model.reading.with_top_k(top_k),
                                memory_routing_grad=routing_grad)
    train = dataclasses.replace(base.train, lr=float(params["lr"]))
    run = dataclasses.replace(base.run, name=f"{sweep_name}-{trial_id}")
    return dataclasses.replace(base, model=model, train=train, run=run).validate()


# ------------------------------------------------------------------------------------------------- the sweep
def run_sweep(sweep: SweepConfig, base: StageConfig) -> dict[str, Any]:
    """Runs the sweep and returns its summary: the table, the best trial, the registered version. ASHA's max_t is one
    evaluation past the last, so only ASHA's own rungs stop a trial: max_t is reached by the report a trial makes
    once its run holds its export (TRIAL_FINISHED), never before."""
    problems = sweep.problems(base) + base.problems()
    if problems:
        raise ValueError("invalid sweep:\n  - " + "\n  - ".join(problems))
    sweep = sweep.for_base(base)
    base = prepare_paths(base)  # tiny checkpoints written once, before trials race to write them
    tracking_uri = resolve_tracking_uri(base.tracking.tracking_uri)
    base = dataclasses.replace(base, tracking=dataclasses.replace(base.tracking, tracking_uri=tracking_uri))
    parent = open_sweep_run(sweep, base, tracking_uri) if base.tracking.enabled else Tracker(None, None)
    if not ray.is_initialized():
        ray.init(log_to_driver=True)
    concurrency = max_concurrent_trials(sweep, base)
    space = {
        "fusion": ray.tune.choice(sweep.fusion_choices(base)),
        "memory_top_k": ray.tune.choice(sweep.memory_top_k_choices(base)),
        "lora_rank": ray.tune.choice(sweep.lora_rank_choices(base)),
        "gca_layers": ray.tune.choice(sweep.placement_specs(base)),
        "lr": ray.tune.loguniform(sweep.lr_min, sweep.lr_max),
        "base": base.to_dict(), "sweep_name": sweep.name, "parent_run_id": parent.run_id, "metric": sweep.metric,
    }
    tuner = ray.tune.Tuner(
        ray.tune.with_resources(train_trial, {"cpu": sweep.trial_cpus}),
        param_space=space,
        tune_config=ray.tune.TuneConfig(
            # The cap lives in the generator: Tune ignores TuneConfig.max_concurrent_trials for a generator search.
            num_samples=sweep.num_samples,
            search_alg=BasicVariantGenerator(random_state=sweep.seed, max_concurrent=concurrency),
            scheduler=ASHAScheduler(metric=sweep.metric, mode=sweep.mode, grace_period=sweep.grace_period,
                                    reduction_factor=sweep.reduction_factor,
                                    max_t=max(sweep.grace_period, base.train.max_steps // base.train.eval_every) + 1),
        ),
        run_config=ray.tune.RunConfig(name=sweep.name, storage_path=base.run.storage_path,
                                      failure_config=ray.tune.FailureConfig(max_failures=0)),
    )
    started = time.perf_counter()
    results = tuner.fit()
    wall = time.perf_counter() - started
    rows = trial_rows(results, sweep, base)
    attach_child_runs(rows, parent, tracking_uri)
    summary = finish_sweep(sweep, base, parent, rows, wall, concurrency, tracking_uri)
    return summary


def max_concurrent_trials(sweep: SweepConfig, base: StageConfig) -> int:
    """Trials that fit at once: the cluster's CPUs (GPUs) over what one trial and its Train workers reserve (the
    workers read their corpus shards themselves, on their own CPUs). More would start trials whose workers can never
    be placed (WorkerGroupStartupTimeoutError, retried forever)."""
    if sweep.max_concurrent > 0:
        return sweep.max_concurrent
    s, resources = base.scaling, ray.cluster_resources()
    by_cpu = resources.get("CPU", 1) / (sweep.trial_cpus + s.num_workers * s.cpus_per_worker)
    by_gpu = resources.get("GPU", 0) / s.num_workers if s.use_gpu else math.inf
    fits = int(min(by_cpu, by_gpu) + 1e-9)
    if fits < 1:
        raise ValueError(
            f"one trial needs {sweep.trial_cpus} + {s.num_workers} x {s.cpus_per_worker} CPUs"
            f"{f' and {s.num_workers} GPUs' if s.use_gpu else ''}"
            f", the cluster has {resources.get('CPU', 0)} CPUs and {resources.get('GPU', 0)} GPUs: lower "
            f"scaling.num_workers or scaling.cpus_per_worker"
        )
    return min(fits, sweep.num_samples)


def open_sweep_run(sweep: SweepConfig, base: StageConfig, tracking_uri: str) -> Tracker:
    config = {"sweep": dataclasses.asdict(sweep) | {"placements": sweep.placement_specs(base),
                                                    "fusions": sweep.fusion_choices(base),
                                                    "memory_top_ks": sweep.memory_top_k_choices(base)},
              "base": base.to_dict()}
    tags = {"sweep": "true", "pair": base.model.pair, "stage": str(base.stage), "git.commit": git_commit(),
            **system_info()}
    return Tracker.start(tracking_uri, base.tracking.experiment, sweep.name, config, tags)


def trial_rows(results, sweep: SweepConfig, base: StageConfig) -> list[dict[str, Any]]:
    """One row per trial: its hyper-parameters, last evaluation, cost, and its final export (when it finished)."""
    rows = []
    accuracy = accuracy_metric(base)
    depth = PAIRS[base.model.pair].decoder_config["num_hidden_layers"]
    cpus = sweep.trial_cpus + base.scaling.num_workers * base.scaling.cpus_per_worker
    for result in results:
        m, c = result.metrics or {}, result.config
        steps = int(m.get("examples_seen", 0) // base.train.memories_per_step)
        checkpoint = m.get("checkpoint_path")
        finished = bool(m.get(TRIAL_FINISHED))
        export = f"{checkpoint}/export" if checkpoint and finished else None
        seconds = float(m.get("time_total_s", 0.0))
        rows.append({
            "trial_id": m.get("trial_id") or Path(result.path).name, "fusion": c["fusion"],
            "lora_rank": c["lora_rank"], "placement": c["gca_layers"],
            "gca_layers": memory_layers(c["fusion"], c["gca_layers"], depth), "lr": c["lr"],
            "memory_top_k": 0 if c["fusion"] == "merged" else c.get("memory_top_k", base.model.reading.top_k),
            sweep.metric: m.get(sweep.metric), accuracy: m.get(accuracy),
            "no_memory_val_loss": m.get("no_memory_val_loss"), "steps": steps,
            "stopped_early": not finished and result.error is None,
            "seconds": round(seconds, 1), "cpu_seconds": round(seconds * cpus, 1),
            "export": export if export and Path(export).is_dir() else None,
            "error": repr(result.error) if result.error else None, "mlflow_run_id": None,
        })
    return rows


def memory_layers(fusion: str, placement: str, depth: int) -> list[int]:
    """The layers that read the memory: the placement's for gca, every layer for cross and merged."""
    return resolve_gca_layers(placement, depth) if fusion == "gca" else list(range(depth))


def attach_child_runs(rows: list[dict[str, Any]], parent: Tracker, tracking_uri: str) -> None:
    """Finds each trial's nested MLflow run; a run ASHA stopped never reached its own close, so it is marked KILLED
    here (its metrics, params and checkpoints up to the stop are kept), even when the stop landed after its last
    evaluation (seen in CI: a trial at max_steps whose run had no export). A trial that finished (its own last report
    says so) but whose close is still queued (a slow tracking server) is marked FINISHED."""
    if parent.client is None:
        return
    client = MlflowClient(tracking_uri)
    experiment = client.get_run(parent.run_id).info.experiment_id
    runs = client.search_runs([experiment], filter_string=f"tags.`{SWEEP_TAG}` = '{parent.run_id}'")
    by_trial = {run.data.tags.get(TRIAL_TAG): run for run in runs}
    for row in rows:
        run = by_trial.get(row["trial_id"])
        if run is None:
            continue
        row["mlflow_run_id"] = run.info.run_id
        if run.info.status == "RUNNING":  # stopped by ASHA, or its own close did not reach the server in time
            client.set_tag(run.info.run_id, "sweep.stopped_early", str(row["stopped_early"]).lower())
            status = "FAILED" if row["error"] else "KILLED" if row["stopped_early"] else "FINISHED"
            client.set_terminated(run.info.run_id, status)


def finish_sweep(sweep: SweepConfig, base: StageConfig, parent: Tracker, rows: list[dict[str, Any]], wall: float,
                 concurrency: int, tracking_uri: str) -> dict[str, Any]:
    """Prints and logs the table and its plot, registers the best finished trial, closes the parent run."""
    table = format_table(rows, sweep.metric, accuracy_metric(base))
    print(table, flush=True)
    best = best_row(rows, sweep)
    parent.log_table({k: [str(r[k]) if isinstance(r[k], list) else r[k] for r in rows] for k in rows[0]},
                     "sweep/trials.json")
    parent.log_text(table, "sweep/table.md")
    figure = plot_sweep(rows, sweep.metric)
    parent.log_figure(figure, "sweep_rank_x_placement.png")  # columns: fusion and placement
    parent.log_metrics({"sweep_wall_seconds": wall, "sweep_cpu_seconds": sum(r["cpu_seconds"] for r in rows),
                        "trials_finished": sum(r["export"] is not None for r in rows),
                        "trials_stopped_early": sum(r["stopped_early"] for r in rows),
                        **({f"best_{sweep.metric}": best[sweep.metric]} if best else {})}, step=0)
    registered = None
    if best and sweep.registered_model and best["mlflow_run_id"]:
        parent.set_tags({"sweep.best_run_id": best["mlflow_run_id"], "sweep.best_trial": best["trial_id"]})
        version = register_run(best["mlflow_run_id"], tracking_uri=tracking_uri, name=sweep.registered_model,
                               alias=sweep.alias, sweep_run_id=parent.run_id)
        registered = {"name": sweep.registered_model, "version": version.version, "alias": sweep.alias}
    unlogged = parent.close("FINISHED" if best else "FAILED")
    return {
        "job": "sweep", "pair": base.model.pair, "stage": base.stage, "trials": len(rows),
        "max_concurrent_trials": concurrency, "wall_seconds": round(wall, 1), "best": best, "registered": registered,
        "mlflow_run_id": parent.run_id, "table": rows, "tracking_unlogged": unlogged,
    }


def best_row(rows: list[dict[str, Any]], sweep: SweepConfig) -> dict[str, Any] | None:
    """The best trial that ran to the end (an early-stopped trial has no final export to register)."""
    finished = [r for r in rows if r["export"] and r[sweep.metric] is not None]
    if not finished:
        return None
    sign = 1 if sweep.mode == "min" else -1
    return min(finished, key=lambda r: sign * r[sweep.metric])


@dataclass
class SweepJob(StageConfig):
    """jobs/sweep.py's one config: the trials' stage config (every section, the same for each trial; `stage` picks
    the preset) and the `sweep` section."""

    sweep: SweepConfig = field(default_factory=SweepConfig)

    @classmethod
    def for_stage(cls, stage: int) -> "SweepJob":
        base = sweep_base(None, stage)
        return cls(**{f.name: getattr(base, f.name) for f in dataclasses.fields(StageConfig)})

    def base(self) -> StageConfig:
        """The trials' stage config; their Ray Train runs are named after the sweep."""
        config = StageConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(StageConfig)})
        return dataclasses.replace(config, run=dataclasses.replace(config.run, name=self.sweep.name))

    def problems(self) -> list[str]:
        base = self.base()
        p = base.problems() + self.sweep.problems(base)
        if self.stage not in (0, 1, 2):
            p.append(f"stage {self.stage}: sweeps run stage 0, 1 or 2")
        if self.stage in (1, 2) and self.model.pair in PAIRS and vocab_problem(self.model.pair):
            p.append(vocab_problem(self.model.pair))
        return p
