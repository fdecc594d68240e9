"""What every evaluation suite shares: the systems under evaluation (a `--model` reference resolved to a `Source`, an
export on disk, then loaded inside a worker as a `System`), the run's worker settings, and the `Suite` protocol
through which pipelines.evaluate.job runs each suite on each system.

A suite module (needle, efficiency, code_qa, commits) holds its settings, its Ray Data actor, its run and its
metrics; the job knows none of them by name beyond its registry.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Protocol, TextIO

from models import AwarenessModel
from models.awareness import CONFIG_NAME
from pipelines.data.memory_modes import MemoryMode, read_system, system_mode
from pipelines.data.synthetic_needles import NeedleSpec


def duration(seconds: float) -> str:
    """A job's console time: `9m12s`, `3h02m` (a training step line's ETA, an evaluation's progress line)."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


# ---------------------------------------------------------------------------------------------- systems
@dataclass
class Source:
    """A system to evaluate, as a local export directory and its system.json; `name` labels it in results.json."""

    name: str
    export: str
    system: dict[str, Any]
    run_id: str | None = None  # the training run, when known (metrics are logged onto it too)
    registered: tuple[str, str] | None = None  # (name, version), for a models:/ URI
    served: str | None = None  # a registered version's pyfunc artifacts: its needles are answered by it, as served


@dataclass(frozen=True)
class System:
    """A loaded model and how it reads its memory; `name` labels it in results.json. `served`: the registered
    version's pyfunc (mlflow.pyfunc.load_model), which then answers instead, text in and text out, as users get it.
    `export`: the directory the model was loaded from (its encoder's identity, for the memory store gca reads)."""

    name: str
    model: AwarenessModel | None
    mode: MemoryMode
    spec: NeedleSpec
    served: Any = None
    export: str | None = None


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
    from mlflow.tracking import MlflowClient  # lazy: mlflow takes seconds to import, and only run ids need it here

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


def name_sources(sources: list[Source], names: list[str] | None) -> None:
    """Labels each source: its given name, else its export's memory mode; two of one mode become gca_1, gca_2."""
    for i, source in enumerate(sources):
        source.name = names[i] if names else source.system.get("memory", "gca")
    taken = [s.name for s in sources]
    for i, source in enumerate(sources):
        if taken.count(source.name) > 1:
            source.name = f"{source.name}_{taken[: i + 1].count(source.name)}"


def load_system(name: str, export: str, system: dict[str, Any], device: str = "cpu", served: str | None = None,
                tracking_uri: str | None = None) -> System:
    """The export as an AwarenessModel, or for a registered version its pyfunc as MLflow serves it."""
    if served:  # explicit URIs: mlflow.set_tracking_uri would also set $MLFLOW_TRACKING_URI for every later process
        import mlflow  # lazy: only a registered version's pyfunc needs it, inside a worker

        local = mlflow.artifacts.download_artifacts(artifact_uri=served, tracking_uri=tracking_uri)
        return System(name, None, system_mode(system), needle_spec(system), served=mlflow.pyfunc.load_model(local))
    model = AwarenessModel.from_pretrained(export).to(device).eval()
    return System(name, model, system_mode(system), needle_spec(system), export=export)


def needle_spec(system: dict[str, Any]) -> NeedleSpec:
    """The needle task the system trained on (its export's system.json); the stage-0 default otherwise."""
    fields = NeedleSpec.__dataclass_fields__
    return NeedleSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in (system.get("needle") or {}).items()
                         if k in fields})  # system.json's lists are the spec's tuples


def batch_columns(rows: list[dict[str, Any]]) -> dict[str, list]:
    """Rows as the columns a Ray Data batch returns (nothing for no rows)."""
    return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


# ---------------------------------------------------------------------------------------------- suites
@dataclass(frozen=True)
class Workers:
    """What every suite's actors run with (the job's --actors, --cpus_per_actor, --use_gpu), where the MLflow
    server is (a registered version's pyfunc is fetched from it) and where results go."""

    actors: int
    cpus_per_actor: float
    use_gpu: bool
    tracking_uri: str
    out: Path


@dataclass
class SuiteResult:
    """One suite on one system: metrics and counts for results.json's entry, `sections` (a results.json key, e.g.
    `heatmaps`, to this system's value under it) and the line printed as the system finishes the suite."""

    metrics: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    sections: dict[str, Any] = field(default_factory=dict)
    line: str = ""


class Suite(Protocol):
    """A suite, built once per job from its settings (reading what every system shares: held-out rows, parent
    trees) before any model is resolved, then run on each system in turn, and closed."""

    name: ClassVar[str]

    def run(self, source: Source) -> SuiteResult: ...

    def close(self) -> None: ...


class Progress:
    """A suite's progress as the training console shows a step: `gca: needle  24/240 probes  elapsed 0m31s  eta
    4m39s` (the ETA from the rate so far). On a terminal the line is rewritten in place; otherwise (a log, `ray job
    logs`) it is printed at the first update, then at most every `every_s` seconds, and when all are done."""

    def __init__(self, label: str, total: int, unit: str = "probes", every_s: float = 30.0,
                 stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.label, self.total, self.unit, self.every_s, self.clock = label, total, unit, every_s, clock
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started, self.shown, self.width = clock(), None, 0

    def line(self, done: int) -> str:
        elapsed = self.clock() - self.started
        eta = f"  eta {duration(elapsed / done * (self.total - done))}" if 0 < done < self.total else ""
        return f"{self.label}  {done}/{self.total} {self.unit}  elapsed {duration(elapsed)}{eta}"

    def update(self, done: int) -> None:
        now = self.clock()
        if self.tty:
            text = self.line(done)
            self.stream.write("\r" + text.ljust(self.width) + ("\n" if done >= self.total else ""))
            self.width = len(text)
        elif self.shown is None or done >= self.total or now - self.shown >= self.every_s:
            self.stream.write(self.line(done) + "\n")
            self.shown = now
        self.stream.flush()
