"""jobs/evaluate.py: score trained systems (gca and its baselines) on the evaluation suites with Ray Data batch
inference, write DIR/results.json and plots, and log them to MLflow.

Each suite is a module of its own (needle, efficiency, code_qa, commits) holding its settings, its Ray Data actor,
its run and its metrics, and follows the `Suite` protocol (pipelines.evaluate.common): built once from its settings,
run on each system in turn, closed. This module only resolves the systems, runs the suites it is given through
`SUITES`, and writes and logs what they return.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray

from pipelines.cli import ConfigError
from pipelines.evaluate.code_qa import CodeQaEvaluation, CodeQaSuite
from pipelines.evaluate.commits import CommitsEvaluation, CommitsSuite
from pipelines.evaluate.common import Source, Suite, Workers, name_sources, resolve_model
from pipelines.evaluate.efficiency import EfficiencyEvaluation, EfficiencySuite
from pipelines.evaluate.needle import NeedleEvaluation, NeedleSuite, needle_table, reread_problems
from pipelines.tracking.tracker import Tracker, resolve_tracking_uri

# name -> the suite, built from EvaluateConfig's field of that name; they run in this order on each system, and
# --help and the errors list them in it
SUITES: dict[str, type[Suite]] = {suite.name: suite for suite in (NeedleEvaluation, CodeQaEvaluation,
                                                                   EfficiencyEvaluation, CommitsEvaluation)}
RESULTS = "results.json"
NEEDLE_TABLE = "needle_table.md"  # every system, task and size of the needle suite, beside results.json
# each suite's headline numbers, in the job's one-line summary
HEADLINE = ("needle/single/1x", "code_qa/exact", "code_qa/read_compliance", "commits/exact", "commits/pass@1",
            "efficiency/encoder_chunks_per_s")


@dataclass
class EvaluateConfig:
    # Systems to score: export directories, MLflow run ids (their `export` artifact) or registered versions
    # (models:/NAME@ALIAS or models:/NAME/VERSION); each names how it reads memory in its export's system.json
    model: list[str] = field(default_factory=list)
    names: list[str] | None = None  # labels in results.json; None: each export's memory mode (gca, rag, ...)
    # needle, code_qa, efficiency, commits (comma/space-separated)
    suite: list[str] = field(default_factory=lambda: ["needle"])
    out: str = "outputs/evaluate"  # results.json and plots go here
    actors: int = 1  # Ray Data actors per system for the needle and commits suites, each holding the model
    cpus_per_actor: float = 1.0  # CPUs Ray reserves for each evaluation actor
    use_gpu: bool = False  # one GPU per actor
    needle: NeedleSuite = field(default_factory=NeedleSuite)  # pipelines.evaluate.needle
    efficiency: EfficiencySuite = field(default_factory=EfficiencySuite)  # pipelines.evaluate.efficiency
    code_qa: CodeQaSuite = field(default_factory=CodeQaSuite)  # held-out repositories: a stage-0 corpus's val split
    commits: CommitsSuite = field(default_factory=CommitsSuite)  # held-out stage-2 commits (pipelines.evaluate.commits)
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here
    experiment: str = "awareness-evaluate"  # the MLflow experiment the evaluation run is logged under
    track: bool = True  # log to MLflow (a new run; also onto the evaluated run or registered version when known)

    def suites(self) -> list[str]:
        return [s for item in self.suite for s in item.split(",") if s]

    def problems(self) -> list[str]:
        p = []
        if not self.model:
            p.append("model: name at least one system: --model EXPORT_DIR [EXPORT_DIR ...] (or a run id, or "
                     "models:/NAME@ALIAS)")
        for suite in self.suites():
            if suite not in SUITES:
                p.append(f"suite {suite!r} is not one of {tuple(SUITES)}")
        if self.names is not None and len(self.names) != len(self.model):
            p.append(f"names: {len(self.names)} names for {len(self.model)} models; give one per --model")
        p += self.needle.problems()  # the needle settings are checked even when the suite is not asked for
        if self.actors < 1:
            p.append("actors must be >= 1")
        if "code_qa" in self.suites():
            p += self.code_qa.problems()
        if "commits" in self.suites():
            p += self.commits.problems()
        return p


def run_evaluation(config: EvaluateConfig) -> dict[str, Any]:
    """Every system through every suite; results.json, plots, MLflow. Returns the job's summary."""
    from pipelines.evaluate import plots  # lazy: matplotlib takes seconds to import, and --help needs none of it

    out = Path(config.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    tracking_uri = resolve_tracking_uri(config.tracking_uri)
    workers = Workers(config.actors, config.cpus_per_actor, config.use_gpu, tracking_uri, out)
    asked = config.suites()
    # built before any model is fetched: a suite's missing corpus fails first
    suites = [suite(getattr(config, name), workers) for name, suite in SUITES.items() if name in asked]
    try:
        workdir = Path(tempfile.mkdtemp(prefix="evaluate-"))
        sources = [resolve_model(m, tracking_uri, workdir) for m in config.model]
        name_sources(sources, config.names)
        problems = reread_problems(config.needle, sources)
        if problems:
            raise ConfigError("; ".join(problems))
        start_ray()
        results: dict[str, Any] = {"systems": {}, "heatmaps": {}, "efficiency": {}, "suites": asked}
        for source in sources:
            results["systems"][source.name] = evaluate_system(source, suites, results)
    finally:
        for suite in suites:
            suite.close()
    (out / RESULTS).write_text(json.dumps(results, indent=1, allow_nan=True))
    table = needle_table(results["systems"])
    if table:
        (out / NEEDLE_TABLE).write_text(table)
    figures = plots.evaluation_figures(results)
    for name, figure in figures.items():
        figure.savefig(out / name, dpi=110, bbox_inches="tight")
    run_id = log_to_mlflow(config, results, figures, sources, tracking_uri) if config.track else None
    for figure in figures.values():
        plots.close(figure)
    return {"job": "evaluate", "results": str(out / RESULTS), "systems": list(results["systems"]),
            "plots": sorted(figures), "mlflow_run_id": run_id,
            **{f"{name}.{key.replace('/', '_')}": entry["metrics"][key]
               for name, entry in results["systems"].items() for key in HEADLINE if key in entry["metrics"]}}


def start_ray() -> None:
    """Joins $RAY_ADDRESS's cluster (or starts a local one) quietly: one printed line per system and suite."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False, logging_level=logging.WARNING)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # one line per system and suite instead
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)


def evaluate_system(source: Source, suites: list[Suite], results: dict[str, Any]) -> dict[str, Any]:
    """One system through the suites: its results.json entry; each suite's sections go under results[section]."""
    entry: dict[str, Any] = {"metrics": {}, "counts": {}, "export": source.export,
                             "memory": source.system.get("memory")}
    for suite in suites:
        result = suite.run(source)
        entry["metrics"] |= result.metrics
        entry["counts"] |= result.counts
        for section, value in result.sections.items():
            results.setdefault(section, {})[source.name] = value
        print(result.line, flush=True)
    return entry


def log_to_mlflow(config: EvaluateConfig, results: dict[str, Any], figures: dict[str, Any], sources: list[Source],
                  tracking_uri: str) -> str:
    """A run of its own (results.json, plots, every metric as system/metric); the same metrics onto each evaluated
    training run (`eval/` prefix), and as tags on a registered version."""
    from mlflow.tracking import MlflowClient  # lazy: mlflow takes seconds to import, and --help needs none of it

    flat = {f"{system}/{name}": float(value) for system, entry in results["systems"].items()
            for name, value in entry["metrics"].items() if isinstance(value, (int, float))}
    tracker = Tracker.start(tracking_uri, config.experiment, "evaluate", asdict(config),
                            tags={"job": "evaluate", "systems": ",".join(results["systems"])})
    tracker.log_metrics(flat, step=0)
    tracker.log_dict(results, RESULTS)
    table = needle_table(results["systems"])
    if table:
        tracker.log_text(table, NEEDLE_TABLE)
    for name, figure in figures.items():
        tracker.log_figure(figure, name)
    tracker.close()
    client = MlflowClient(tracking_uri)
    for source in sources:
        own = {name: float(v) for name, v in results["systems"][source.name]["metrics"].items()
               if isinstance(v, (int, float))}
        if source.run_id:
            for name, value in own.items():
                client.log_metric(source.run_id, f"eval/{name}", value)
            client.set_tag(source.run_id, "eval.run_id", tracker.run_id)
        if source.registered:
            for name, value in own.items():
                client.set_model_version_tag(*source.registered, f"eval.{name}", f"{value:.4g}")
            client.set_model_version_tag(*source.registered, "eval.run_id", tracker.run_id)
    return tracker.run_id
