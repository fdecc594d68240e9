"""What a job plugs into the one driver, worker loop and engine: its data, model, loss inputs, evaluation, export
and summary (a Recipe), and what its entry point needs before any of that is imported: its name, pre-flight check,
dry-run lines and how it runs (a Job, which names its Recipe). Five of each: the stage jobs (`stage`), stage 4's
distillation (`stage4`, with its sequence of runs), the UL2 encoder (`ul2`), the traffic VLM (`traffic`) and the dense
retriever (`retriever`); their Jobs in `jobs`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from pipelines.tracking.tracker import Tracker


@dataclass
class TrainState:
    """What a checkpoint carries besides the engine's shards: where the data stream stands and what was seen."""

    step: int = 0
    examples_seen: int = 0  # memories (or sequences) consumed by all workers
    index_checksum: int = 0  # sum of the example indices consumed: a skipped or repeated example changes it
    world: int = 0  # workers the stream was split over (0: not recorded); a resume must use as many
    loss_first: float | None = None  # the first step's loss, for the summary (Ray keeps only the last report)
    parts_first: dict[str, float] = field(default_factory=dict)  # the first step's loss parts (stage 4: kl, ce)
    gate_history: list[list[float]] = field(default_factory=list)  # [step, |tanh(gate)| per GCA layer...]
    mixture_from: int | None = None  # needles: the step the mixture started at (needle.base_until), so a resumed
    # run draws the same data; None before it starts
    decay: list[int] | None = None  # [first, last]: the learning rate's cosine runs over these steps, at its peak
    # before (engine.Schedule), and the run ends at `last` (needle.mixture_steps); None: over the whole run, which
    # ends at train.max_steps

    def last_step(self, max_steps: int) -> int:
        return self.decay[1] if self.decay else max_steps


@dataclass
class Prepared:
    """The driver's preparation, handed to the Trainer: its config with resolved paths, Ray Datasets (the UL2 job's;
    the stage jobs' workers read their shards themselves), what the workers need besides the config (`worker`), and
    the MLflow run's tags."""

    config: Any
    datasets: dict[str, Any] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


class Stream(Protocol):
    def batch(self, step: int, micro: int) -> tuple[dict[str, torch.Tensor], int, int]:
        """A micro-batch, its example count and the sum of its example indices (0 where examples have none)."""


class Loss(NamedTuple):
    """What a micro-batch's forward gives the loop: the loss backward runs on, and its named parts to log (detached
    scalars, e.g. stage 4's kl and ce; empty for a plain language-model loss)."""

    total: torch.Tensor
    parts: dict[str, torch.Tensor]


def model_loss(engine, batch: dict[str, torch.Tensor]) -> Loss:
    """Today's loss for every recipe: the model's own (transformers' causal-LM cross-entropy on `labels`, plus the
    weighted routing loss of a model that routes its memory, whose unweighted value is logged as `routing_loss`)."""
    out = engine(**{k: v.to(engine.device) for k, v in batch.items()})
    return Loss(out.loss, routing_part(out))


def routing_part(out) -> dict[str, torch.Tensor]:
    """{"routing_loss": ...} when the model's output carries chunk routing's loss (models/gca.py), else {}."""
    routing = getattr(out, "routing_loss", None)
    return {"routing_loss": routing.detach()} if routing is not None else {}


class Recipe(Protocol):
    """One job's parts. Driver side: `prepare`, `summary`; worker side: the rest (it travels pickled)."""

    def parse(self, data: dict[str, Any]) -> Any: ...  # the job's typed config from its dict

    def prepare(self, config: Any) -> Prepared: ...

    def build_model(self, config: Any, worker: dict[str, Any], ds_config: dict[str, Any]) -> torch.nn.Module:
        """The model on this worker; `ds_config` is the DeepSpeed config its engine will get (ZeRO-3 builds
        partitioned)."""

    def parameter_groups(self, model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]: ...

    def stream(self, config: Any, worker: dict[str, Any], rank: int, world: int, start_step: int) -> Stream: ...

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> int: ...

    def loss(self, engine, config: Any, batch: dict[str, torch.Tensor]) -> Loss:
        """The micro-batch's loss; `model_loss` for a job whose model computes its own."""

    def before_step(self, engine, config: Any, state: TrainState, stream: Stream) -> dict[str, float]:
        """Whatever decides the next step's data from the model (stage 0: needle.base_until), before each step;
        what it measured, logged at once (empty on most steps)."""

    def probe(self, engine, config: Any, state: TrainState, stream: Stream) -> dict[str, float]: ...

    def evaluate(self, engine, config: Any, rank: int, world: int) -> dict[str, float]: ...

    def export(self, engine, config: Any, worker: dict[str, Any], directory: Path) -> None: ...

    def finish(self, engine, config: Any, state: TrainState, tracker: Tracker, rank: int, world: int) -> None: ...

    def summary(self, config: Any, metrics: dict[str, Any], export_dir: str | None,
                tracker: Tracker) -> dict[str, Any]:
        """The job's own fields of its summary (the driver adds its name first, and every job's fields)."""


def trainable_groups(model: torch.nn.Module, group_of) -> dict[str, list[torch.nn.Parameter]]:
    """The trainable parameters by `group_of(name)`, in the model's order."""
    groups: dict[str, list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups.setdefault(group_of(name), []).append(param)
    return groups


class Job(Protocol):
    """One job's entry side (pipelines.train.job), kept apart from its Recipe so that --help, --dry-run and a bad
    shard answer without importing Ray Train or DeepSpeed."""

    config: type  # the typed config it runs

    def name(self, config: Any) -> str: ...  # the summary's "job", and the prefix of its refusals

    def check(self, config: Any) -> dict[str, Any]:
        """Pre-flight checks before any cluster time (raises pipelines.format.shards.ShardError); what was checked,
        for the summary, or {} when nothing was."""

    def resolved(self, config: Any) -> Any: ...  # its local paths made absolute, as the driver will

    def dry_run(self, config: Any) -> list[str]: ...  # --dry-run's lines after the resolved config

    def recipe(self) -> Recipe: ...  # its training parts (imports torch, Ray Train and DeepSpeed)

    def run(self, config: Any) -> dict[str, Any]: ...  # its summary; stage 4's is several runs
