"""jobs/evaluate.py: score trained systems (gca and its baselines) on the evaluation suites with Ray Data batch
inference, write DIR/results.json and plots, and log them to MLflow.

Each system's probes are a Ray Dataset of work items (variant, memory size, memory index) mapped by an actor pool
whose actors each load the model once (`map_batches` with a callable class; GPU actors with --use_gpu). Efficiency
runs in one actor per system, so timings never share a device with another measurement.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from models.awareness import CONFIG_NAME
from pipelines.data.batch_inference import items_dataset, map_with_actors
from pipelines.data.memory_modes import read_system, system_mode
from pipelines.data.synthetic_needles import NeedleSpec
from pipelines.evaluate import code_qa
from pipelines.evaluate.code_qa import CodeQaSuite
from pipelines.evaluate.commits import CommitsEvaluation, CommitsSuite, commits_metrics, summary_line
from pipelines.evaluate.metrics import rate_interval
from pipelines.evaluate.ruler import VARIANTS, memory_chunks

SUITES = ("needle", "efficiency", "code_qa", "commits")
RESULTS = "results.json"
# each suite's headline numbers, in the job's one-line summary
HEADLINE = ("needle/single/1x", "code_qa/exact", "code_qa/read_compliance", "commits/exact", "commits/pass@1",
            "efficiency/encoder_chunks_per_s")


@dataclass
class NeedleSuite:
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))  # RULER-style tasks (pipelines.evaluate.ruler)
    multipliers: list[int] = field(default_factory=lambda: [1, 4, 16])  # memory sizes, in training memory sizes
    memories: int = 16  # probe memories per (variant, size); each asks needle.questions questions
    hops: list[int] = field(default_factory=lambda: [2, 3])  # variable-tracking chain lengths
    seed: int = 20261123  # probes come from their own seed, never from training's or validation's
    depth_bins: int = 4


@dataclass
class EfficiencySuite:
    memory_tokens: list[int] = field(default_factory=lambda: [1024, 4096, 16384])  # 65536 too on a GPU
    decode_tokens: int = 16  # tokens generated to time decoding
    repeats: int = 3  # timed calls per point (median), after one warm-up
    encoder_chunks: int = 256  # chunks encoded to time the encoder


@dataclass
class EvaluateConfig:
    # Systems to score: export directories, MLflow run ids (their `export` artifact) or registered versions
    # (models:/NAME@ALIAS or models:/NAME/VERSION); each names how it reads memory in its export's system.json
    model: list[str] = field(default_factory=list)
    names: list[str] | None = None  # labels in results.json; None: each export's memory mode (gca, rag, ...)
    suite: list[str] = field(default_factory=lambda: ["needle"])  # needle, efficiency, code_qa, commits (comma/space-separated)
    out: str = "outputs/evaluate"  # results.json and plots go here
    actors: int = 1  # Ray Data actors per system for the needle and commits suites, each holding the model
    cpus_per_actor: float = 1.0
    use_gpu: bool = False  # one GPU per actor
    needle: NeedleSuite = field(default_factory=NeedleSuite)
    efficiency: EfficiencySuite = field(default_factory=EfficiencySuite)
    code_qa: CodeQaSuite = field(default_factory=CodeQaSuite)  # held-out repositories: a stage-0 corpus's val split
    commits: CommitsSuite = field(default_factory=CommitsSuite)  # held-out stage-2 commits (pipelines.evaluate.commits)
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here
    experiment: str = "awareness-evaluate"
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
                p.append(f"suite {suite!r} is not one of {SUITES}")
        if self.names is not None and len(self.names) != len(self.model):
            p.append(f"names: {len(self.names)} names for {len(self.model)} models; give one per --model")
        bad = set(self.needle.variants) - set(VARIANTS)
        if bad:
            p.append(f"needle.variants {sorted(bad)} unknown; choose from {VARIANTS}")
        if any(m < 1 for m in self.needle.multipliers) or self.needle.memories < 1:
            p.append("needle.multipliers and needle.memories must be positive")
        if any(h < 2 for h in self.needle.hops):
            p.append("needle.hops must be >= 2 (a chain of one is the single task)")
        if self.actors < 1:
            p.append("actors must be >= 1")
        if "code_qa" in self.suites():
            p += self.code_qa.problems()
        if "commits" in self.suites():
            p += self.commits.problems()
        return p


# ---------------------------------------------------------------------------------------------- models
@dataclass
class Source:
    name: str
    export: str
    system: dict[str, Any]
    run_id: str | None = None  # the training run, when known (metrics are logged onto it too)
    registered: tuple[str, str] | None = None  # (name, version), for a models:/ URI
    served: str | None = None  # a registered version's pyfunc artifacts: its needles are answered by it, as served


def resolve_model(reference: str, tracking_uri: str, workdir: Path) -> Source:
    """An export directory, an MLflow run id, or a registered version, as a local export directory."""
    path = Path(reference).expanduser()
    if path.is_dir():
        if not (path / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"{path} is not an export (no {CONFIG_NAME}): pass the `export` path a "
                                    f"stage job's summary line names")
        return Source("", str(path.resolve()), read_system(path))
    if not reference.startswith("models:/") and not re.fullmatch(r"[0-9a-f]{32}", reference):
        raise FileNotFoundError(f"--model {reference}: not an export directory, a run id (32 hex digits) or a "
                                f"models:/NAME@ALIAS URI")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    if reference.startswith("models:/"):
        name, _, ref = reference[len("models:/"):].partition("@")
        version = client.get_model_version_by_alias(name, ref) if ref else client.get_model_version(
            *reference[len("models:/"):].split("/", 1))
        run_id = version.run_id
        registered = (version.name, str(version.version))
        served = client.get_model_version_download_uri(version.name, version.version)  # its pyfunc, where it lies
    else:
        run_id, registered, served = reference, None, None
    names = {a.path for a in client.list_artifacts(run_id)}
    if "export" not in names:
        raise FileNotFoundError(f"MLflow run {run_id} has no `export` artifact: evaluate a run that finished training")
    export = client.download_artifacts(run_id, "export", str(workdir / run_id))
    return Source("", export, read_system(export), run_id=run_id, registered=registered, served=served)


def load_system(name: str, export: str, system: dict[str, Any], device: str = "cpu", served: str | None = None,
                tracking_uri: str | None = None):
    """The export as an AwarenessModel, or for a registered version its pyfunc as MLflow serves it."""
    from models import AwarenessModel
    from pipelines.evaluate.suites import System

    if served:  # explicit URIs: mlflow.set_tracking_uri would also set $MLFLOW_TRACKING_URI for every later process
        import mlflow

        local = mlflow.artifacts.download_artifacts(artifact_uri=served, tracking_uri=tracking_uri)
        return System(name, None, system_mode(system), needle_spec(system), served=mlflow.pyfunc.load_model(local))
    model = AwarenessModel.from_pretrained(export).to(device).eval()
    return System(name, model, system_mode(system), needle_spec(system), export=export)


def needle_spec(system: dict[str, Any]) -> NeedleSpec:
    """The needle task the system trained on (its export's system.json); the stage-0 default otherwise."""
    fields = NeedleSpec.__dataclass_fields__
    return NeedleSpec(**{k: v for k, v in (system.get("needle") or {}).items() if k in fields})


# ---------------------------------------------------------------------------------------------- Ray Data actors
class NeedleScorer:
    """A Ray Data actor: loads one system, scores batches of probe items."""

    def __init__(self, name: str, export: str, system: dict[str, Any], depth_bins: int, seed: int, use_gpu: bool,
                 served: str | None = None, tracking_uri: str | None = None):
        self.system = load_system(name, export, system, "cuda" if use_gpu else "cpu", served, tracking_uri)
        self.depth_bins, self.seed = depth_bins, seed

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        from pipelines.evaluate.suites import score_probe

        rows: list[dict[str, Any]] = []
        for variant, multiplier, hops, index in zip(batch["variant"], batch["multiplier"], batch["hops"],
                                                    batch["index"], strict=True):
            rows += score_probe(self.system, str(variant), int(multiplier), self.seed, int(index), hops=int(hops),
                                depth_bins=self.depth_bins)
        return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


class EfficiencyMeter:
    def __init__(self, name: str, export: str, system: dict[str, Any], settings: dict[str, Any], use_gpu: bool):
        self.system = load_system(name, export, system, "cuda" if use_gpu else "cpu")
        self.settings = settings

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        from pipelines.evaluate.suites import efficiency_row, encoder_throughput, rag_retrieval_s

        s = self.settings
        rows = []
        for tokens in batch["memory_tokens"]:
            row = efficiency_row(self.system, int(tokens), decode_tokens=s["decode_tokens"], repeats=s["repeats"])
            row["retrieval_s"] = rag_retrieval_s(self.system, int(tokens)) if self.system.mode.kind == "rag" else 0.0
            row["encoder_chunks_per_s"] = (encoder_throughput(self.system, s["encoder_chunks"])
                                           if self.system.mode.kind == "gca" else 0.0)
            row["encode_s"] = row.get("encode_s", 0.0)
            rows.append(row)
        return {key: [row[key] for row in rows] for key in rows[0]}


class CodeQaScorer:
    """A Ray Data actor: loads one system, answers and scores batches of held-out corpus rows."""

    def __init__(self, name: str, export: str, system: dict[str, Any], max_new_tokens: int, use_gpu: bool,
                 served: str | None = None, tracking_uri: str | None = None):
        self.system = load_system(name, export, system, "cuda" if use_gpu else "cpu", served, tracking_uri)
        self.max_new_tokens = max_new_tokens

    def __call__(self, batch) -> dict[str, list]:
        rows = code_qa.score_rows(self.system, batch.to_pylist(), self.max_new_tokens)  # batch: a pyarrow Table
        return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


def needle_items(config: EvaluateConfig) -> list[dict[str, Any]]:
    items = []
    for variant in config.needle.variants:
        for multiplier in config.needle.multipliers:
            for hops in (config.needle.hops if variant == "variable_tracking" else [2]):
                items += [{"variant": variant, "multiplier": multiplier, "hops": hops, "index": i}
                          for i in range(config.needle.memories)]
    return items


def run_needles(config: EvaluateConfig, source: Source, tracking_uri: str) -> list[dict[str, Any]]:
    scored = map_with_actors(
        items_dataset(needle_items(config), per_block=4), NeedleScorer, actors=config.actors, batch_size=4,
        cpus_per_actor=config.cpus_per_actor, use_gpu=config.use_gpu,
        constructor_kwargs={"name": source.name, "export": source.export, "system": source.system,
                            "depth_bins": config.needle.depth_bins, "seed": config.needle.seed,
                            "use_gpu": config.use_gpu, "served": source.served, "tracking_uri": tracking_uri})
    return scored.take_all()


def run_code_qa(config: EvaluateConfig, source: Source, rows: list[dict[str, Any]],
                tracking_uri: str) -> list[dict[str, Any]]:
    scored = map_with_actors(
        items_dataset(rows, per_block=4), CodeQaScorer, actors=config.actors, batch_size=4, batch_format="pyarrow",
        cpus_per_actor=config.cpus_per_actor, use_gpu=config.use_gpu,
        constructor_kwargs={"name": source.name, "export": source.export, "system": source.system,
                            "max_new_tokens": config.code_qa.max_new_tokens, "use_gpu": config.use_gpu,
                            "served": source.served, "tracking_uri": tracking_uri})
    return scored.take_all()


def run_efficiency(config: EvaluateConfig, source: Source) -> list[dict[str, Any]]:
    """One actor measures every memory size in one batch, so no two timings share a device."""
    measured = map_with_actors(
        items_dataset([{"memory_tokens": n} for n in config.efficiency.memory_tokens], per_block=None),
        EfficiencyMeter, actors=1, batch_size=len(config.efficiency.memory_tokens),
        cpus_per_actor=config.cpus_per_actor, use_gpu=config.use_gpu,
        constructor_kwargs={"name": source.name, "export": source.export, "system": source.system,
                            "settings": asdict(config.efficiency), "use_gpu": config.use_gpu})
    return sorted(measured.take_all(), key=lambda row: row["memory_tokens"])


# ---------------------------------------------------------------------------------------------- results
def needle_metrics(rows: list[dict[str, Any]], spec: NeedleSpec, depth_bins: int) -> tuple[dict, dict, dict]:
    """metrics (rates with their 95% Wilson intervals), counts, and the single-needle heatmap (depth x size)."""
    metrics: dict[str, Any] = {}
    counts: dict[str, int] = {}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["variant"], int(row["multiplier"])), []).append(row)
    for (variant, multiplier), group in sorted(groups.items()):
        name = f"needle/{variant}/{multiplier}x"
        exact = sum(bool(r["exact"]) for r in group)
        metrics[name] = exact / len(group)
        metrics[f"{name}/ci95"] = list(rate_interval(exact, len(group)))
        metrics[f"{name}/string_match"] = sum(float(r["score"]) for r in group) / len(group)
        counts[name] = len(group)
        read = [r for r in group if not math.isnan(r.get("evidence_mass", math.nan))]  # a gca system's rows
        if read:
            metrics[f"attention/{variant}/{multiplier}x/evidence_mass"] = sum(r["evidence_mass"] for r in read) / len(read)
            top = sum(int(r["top_chunk"]) for r in read)
            metrics[f"attention/{variant}/{multiplier}x/top_chunk"] = top / len(read)
            metrics[f"attention/{variant}/{multiplier}x/top_chunk/ci95"] = list(rate_interval(top, len(read)))
    sizes = sorted({int(r["multiplier"]) for r in rows if r["variant"] == "single"})
    heatmap = {"memory_tokens": [memory_chunks(spec, m) * spec.chunk_len for m in sizes], "accuracy_by_depth": []}
    for b in range(depth_bins):
        line = []
        for m in sizes:
            cell = [r for r in groups.get(("single", m), []) if int(r["depth_bin"]) == b]
            line.append(sum(bool(r["exact"]) for r in cell) / len(cell) if cell else float("nan"))
        heatmap["accuracy_by_depth"].append(line)
    return metrics, counts, heatmap


def efficiency_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    metrics = {}
    for row in rows:
        n = int(row["memory_tokens"])
        for key in ("ttft_s", "decode_s_per_token", "peak_mib", "encode_s", "retrieval_s"):
            metrics[f"efficiency/{key}/{n}"] = float(row[key])
    speeds = [float(r["encoder_chunks_per_s"]) for r in rows if r["encoder_chunks_per_s"]]
    if speeds:
        metrics["efficiency/encoder_chunks_per_s"] = max(speeds)
    return metrics


def run_evaluation(config: EvaluateConfig) -> dict[str, Any]:
    """Every system through every suite; results.json, plots, MLflow. Returns the job's summary."""
    import ray

    from pipelines.evaluate import plots
    from pipelines.tracking.tracker import resolve_tracking_uri

    out = Path(config.out).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    tracking_uri = resolve_tracking_uri(config.tracking_uri)
    held_out = code_qa.held_out_rows(config.code_qa) if "code_qa" in config.suites() else []  # before any model
    workdir = Path(tempfile.mkdtemp(prefix="evaluate-"))
    sources = [resolve_model(m, tracking_uri, workdir) for m in config.model]
    for i, source in enumerate(sources):
        source.name = config.names[i] if config.names else source.system.get("memory", "gca")
    taken = [s.name for s in sources]
    for i, source in enumerate(sources):  # two exports of one mode: gca, gca_2
        if taken.count(source.name) > 1:
            source.name = f"{source.name}_{taken[: i + 1].count(source.name)}"
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False, logging_level=logging.WARNING)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # one line per system and suite instead
    context.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    results: dict[str, Any] = {"systems": {}, "heatmaps": {}, "efficiency": {}, "suites": config.suites()}
    commits = CommitsEvaluation(config.commits) if "commits" in config.suites() else None
    for source in sources:
        entry: dict[str, Any] = {"metrics": {}, "counts": {}, "export": source.export, "memory": source.system.get("memory")}
        spec = needle_spec(source.system)
        if "needle" in config.suites():
            rows = run_needles(config, source, tracking_uri)
            metrics, counts, heatmap = needle_metrics(rows, spec, config.needle.depth_bins)
            entry["metrics"] |= metrics
            entry["counts"] |= counts
            results["heatmaps"][source.name] = heatmap
            single = {k: v for k, v in metrics.items() if k.startswith("needle/single/") and k.endswith("x")}
            print(f"{source.name}: needle " + "  ".join(f"{k.split('/')[-1]} {v:.2f}" for k, v in single.items()),
                  flush=True)
        if "code_qa" in config.suites():
            rows = run_code_qa(config, source, held_out, tracking_uri)
            metrics, counts = code_qa.code_qa_metrics(rows)
            entry["metrics"] |= metrics
            entry["counts"] |= counts
            with open(out / f"code_qa_{source.name}.jsonl", "w") as answers:  # every answer, to read what it said
                answers.writelines(json.dumps(row) + "\n" for row in rows)
            print(code_qa.summary_line(source.name, metrics, counts), flush=True)
        if "efficiency" in config.suites():
            rows = run_efficiency(config, source)
            results["efficiency"][source.name] = rows
            entry["metrics"] |= efficiency_metrics(rows)
            print(f"{source.name}: ttft " + "  ".join(f"{r['memory_tokens']}: {r['ttft_s'] * 1000:.1f} ms"
                                                       for r in rows), flush=True)
        if commits is not None:
            rows = commits.run(source, actors=config.actors, cpus_per_actor=config.cpus_per_actor,
                               use_gpu=config.use_gpu)
            metrics, counts = commits_metrics(rows)
            entry["metrics"] |= metrics
            entry["counts"] |= counts
            results.setdefault("commits", {})[source.name] = rows
            print(f"{source.name}: {summary_line(metrics, counts)}", flush=True)
        results["systems"][source.name] = entry
    if commits is not None:
        commits.close()
    (out / RESULTS).write_text(json.dumps(results, indent=1, allow_nan=True))
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


def log_to_mlflow(config: EvaluateConfig, results: dict[str, Any], figures: dict[str, Any], sources: list[Source],
                  tracking_uri: str) -> str:
    """A run of its own (results.json, plots, every metric as system/metric); the same metrics onto each evaluated
    training run (`eval/` prefix), and as tags on a registered version."""
    from mlflow.tracking import MlflowClient

    from pipelines.tracking.tracker import Tracker

    flat = {f"{system}/{name}": float(value) for system, entry in results["systems"].items()
            for name, value in entry["metrics"].items() if isinstance(value, (int, float))}
    tracker = Tracker.start(tracking_uri, config.experiment, "evaluate", asdict(config),
                            tags={"job": "evaluate", "systems": ",".join(results["systems"])})
    tracker.log_metrics(flat, step=0)
    tracker.log_dict(results, RESULTS)
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
