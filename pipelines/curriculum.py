"""The curriculum: stages 0 -> 1 -> 2 -> 3 -> 4 as one chain of the documented jobs, each starting from the one before.

Every step is the job a user would run by hand (`python jobs/<job>.py ...`, as its own process, as `ray job
submit` would run it), built from the steps before it (a training step's typed config: its job's preset with the
curriculum's settings, given as its --config file): the corpora, each stage's export as the next one's
`model.init_from`, the in_context teacher that improves stage 3's data and teaches stage 4. After each training
stage its MLflow run is tagged with the curriculum and the run before it, and (with `register`) its export is
registered as a model version tagged with the version before it. Each step's summary line is kept in
OUT/summaries/<step>.json; a rerun skips the steps that finished, so a curriculum cut off midway continues.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

from pipelines.tracking.tracker import flatten, resolve_tracking_uri
from pipelines.train.presets import STAGE0, STAGE1, STAGE2, STAGE4

REPOSITORY = Path(__file__).resolve().parents[1]
TRAINING = ("stage0", "stage1", "stage2", "teacher", "stage4")  # steps with an MLflow run and an export
PREVIOUS = {"stage1": "stage0", "stage2": "stage1", "stage4": "stage2"}  # the stage each one starts from
PRESETS = {"stage0": STAGE0, "stage1": STAGE1, "stage2": STAGE2, "stage4": STAGE4}  # each training job's default


@dataclass
class CurriculumConfig:
    sources: list[str] = field(default_factory=lambda: [str(REPOSITORY)])  # a git repository (stage 2 mines its
    # history); None of its code is run. Default: this repository
    out: str = "outputs/curriculum"  # corpora, runs, summaries
    pair: str = "tiny-text"  # every stage trains this pair (models.PAIRS); real pairs need --checkpoint_root
    checkpoint_root: str | None = None  # None: $AWARENESS_CHECKPOINT_ROOT, or the tiny pairs' random checkpoints
    steps: int = 20  # optimizer steps per training stage (stages 0, 1, 2 and the student of stage 4)
    teacher_steps: int = 40  # the in_context teacher's steps (it must beat the student for stages 3-4 to help)
    memories_per_step: int = 2  # every stage's global batch, in rows
    max_commits: int = 8  # stage 2 corpus: the newest commits per repository
    max_tokens: int = 1024  # decoder tokens per packed row (logits over Qwen3's 151,936 ids dominate memory)
    max_chunks: int = 8  # memory chunks per row, in every stage
    attempts: int = 4  # stage 3: candidates sampled per example
    stage3_rows: int = 8  # stage 3: stage-2 examples the teacher improves
    max_new_tokens: int = 256  # stage 3: tokens per candidate (the tiny teacher rarely stops by itself)
    num_workers: int = 2  # Ray Train workers per stage
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else ./mlflow.db
    register: bool = True  # register each stage's export in the MLflow model registry, chained by tags
    model_name: str = "awareness-curriculum"  # the registered model the versions go to

    def problems(self) -> list[str]:
        p = [f"{name} must be positive, got {getattr(self, name)}" for name in
             ("steps", "teacher_steps", "memories_per_step", "max_commits", "max_tokens", "max_chunks", "attempts",
              "stage3_rows", "max_new_tokens", "num_workers") if getattr(self, name) <= 0]
        if self.memories_per_step % self.num_workers:
            p.append(f"memories_per_step ({self.memories_per_step}) must divide over num_workers ({self.num_workers})")
        for source in self.sources:
            if not (Path(source) / ".git").exists():
                p.append(f"source {source} is not a git repository: stage 2 mines its commit history (pass "
                         f"--sources PATH/TO/A/CLONE)")
        return p


class Splits(NamedTuple):
    train: str
    val: str


@dataclass
class Step:
    name: str  # stage0 ... stage4, corpus0, corpus2, teacher
    job: str  # jobs/<job>.py
    args: Callable[[dict[str, dict]], list[str]] | None = None  # from the summaries of the steps before it
    # a training step's typed config, from the summaries of the steps before it (given as its --config file)
    config: Callable[[dict[str, dict]], Any] | None = None

    def config_file(self, out: Path) -> Path:
        return out / "configs" / f"{self.name}.json"

    def command(self, done: dict[str, dict], out: Path) -> list[str]:
        """The job's command line; a training step's config written first to its --config file."""
        if self.config is None:
            return [sys.executable, str(REPOSITORY / "jobs" / f"{self.job}.py"), *self.args(done)]
        file = self.config_file(out)
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(dataclasses.asdict(self.config(done)), indent=1))
        return [sys.executable, str(REPOSITORY / "jobs" / f"{self.job}.py"), "--config", str(file)]


def steps(config: CurriculumConfig) -> list[Step]:
    """The chain. Stages 1 and 2 train and validate on the same commit corpus when it has no held-out split (one
    source repository is held out whole or not at all)."""
    out = Path(config.out).resolve()
    corpus0, corpus2, corpus3 = out / "corpus0", out / "corpus2", out / "corpus3"

    def training(preset, name: str, steps: int, data: Splits, *, decoder: str = "lora", **changes):
        """`preset` (the job's own default) with the curriculum's settings: every stage the same model settings, so
        each export loads into the next stage's model."""
        model = dataclasses.replace(preset.model, pair=config.pair, gca_layers="upper_third", decoder=decoder,
                                    encoder="frozen", encoder_attention="bidirectional",
                                    checkpoint_root=config.checkpoint_root or preset.model.checkpoint_root,
                                    **changes.pop("model", {}))
        return dataclasses.replace(
            preset, model=model,
            data=dataclasses.replace(preset.data, max_tokens=config.max_tokens, max_chunks=config.max_chunks,
                                     train_path=data.train, val_path=data.val),
            train=dataclasses.replace(preset.train, max_steps=steps, memories_per_step=config.memories_per_step,
                                      eval_every=steps, checkpoint_every=steps, log_every=max(1, steps // 5),
                                      **changes.pop("train", {})),
            scaling=dataclasses.replace(preset.scaling, num_workers=config.num_workers),
            run=dataclasses.replace(preset.run, name=f"curriculum-{name}", storage_path=str(out / "ray")),
            tracking=dataclasses.replace(preset.tracking, tracking_uri=resolve_tracking_uri(config.tracking_uri)),
            **changes)

    def splits(corpus: Path) -> Splits:
        val = corpus / "val" if any((corpus / "val").glob("*.parquet")) else corpus / "train"
        return Splits(train=str(corpus / "train"), val=str(val))

    def distill_splits(done: dict[str, dict]) -> Splits:
        """Stage 4 trains on stage 3's accepted rows and validates on stage 2's held-out rows; when stage 3 accepted
        nothing (a teacher too weak to write a verified edit), on the stage-2 corpus itself, as its summary says."""
        accepted = done.get("stage3", {}).get("accepted") or 0
        train = corpus3 / "train" if accepted else corpus2 / "train"
        return Splits(train=str(train), val=splits(corpus2).val)

    def export(done: dict[str, dict], name: str) -> dict[str, Any]:
        return {"model": {"init_from": done[name]["export"]}}

    return [
        Step("corpus0", "build_corpus", lambda done: [
            "--stage", "0", "--sources", *tracked_directories(config.sources), "--stage0.val_fraction", "0.2",
            "--out", str(corpus0)]),
        Step("corpus2", "build_corpus", lambda done: [
            "--stage", "2", "--sources", *config.sources, "--max_commits", str(config.max_commits),
            "--out", str(corpus2)]),
        # stage 0 on the code Q&A corpus (not the synthetic needles), so its export fits the text pair of stages 1-4
        Step("stage0", "stage0", config=lambda done: training(STAGE0, "stage0", config.steps, splits(corpus0))),
        Step("stage1", "stage1", config=lambda done: training(
            STAGE1, "stage1", config.steps, splits(corpus2), train={"frozen_decoder_steps": config.steps // 2},
            **export(done, "stage0"))),
        Step("stage2", "stage2", config=lambda done: training(STAGE2, "stage2", config.steps, splits(corpus2),
                                                              **export(done, "stage1"))),
        # the teacher of stages 3 and 4: the same decoder, trained with the repository's chunks in its prompt. A
        # quarter of a row's tokens for the chunks: stage 4's teacher scores a row only when chunks, prompt and target
        # all fit its context (the tiny decoder's 1024 positions), and this repository's stage-2 rows hold 650-1,450
        # tokens of prompt and target (a full or half budget made it skip every row)
        Step("teacher", "stage2", config=lambda done: training(
            STAGE2, "teacher", config.teacher_steps, splits(corpus2), decoder="full",
            model={"memory": "in_context", "context_budget": config.max_tokens // 4})),
        Step("stage3", "stage3_data", lambda done: [
            "--corpus", str(corpus2), "--teacher", done["teacher"]["export"], "--out", str(corpus3),
            "--attempts", str(config.attempts), "--max_rows", str(config.stage3_rows),
            "--max_new_tokens", str(config.max_new_tokens)]),
        Step("stage4", "stage4", config=lambda done: training(
            STAGE4, "stage4", config.steps, distill_splits(done), **export(done, "stage2"),
            distill=dataclasses.replace(STAGE4.distill, teacher=done["teacher"]["export"]))),
    ]


def tracked_directories(sources: list[str]) -> list[str]:
    """Stage 0's sources: each repository's first-level directories that git tracks, each its own repository (so one
    can be held out for validation), leaving out what a working tree holds untracked (a venv, outputs, this
    curriculum's own corpora). A repository with no tracked directory is read whole."""
    found = []
    for source in sources:
        listed = subprocess.run(["git", "-C", source, "ls-tree", "-d", "--name-only", "HEAD"], capture_output=True,
                                text=True, check=False)
        names = listed.stdout.split() if listed.returncode == 0 else []
        found += [str(Path(source) / name) for name in names] or [source]
    return found


def run_curriculum(config: CurriculumConfig, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Runs the steps not yet done, in order; stops at the first that fails (its summary names the error)."""
    out = Path(config.out).resolve()
    (out / "summaries").mkdir(parents=True, exist_ok=True)
    done: dict[str, dict] = {}
    chain = steps(config)
    for n, step in enumerate(chain, 1):
        record = out / "summaries" / f"{step.name}.json"
        if record.is_file():
            done[step.name] = json.loads(record.read_text())
            progress(f"[{n}/{len(chain)}] {step.name}: done before ({record})")
            continue
        progress(f"[{n}/{len(chain)}] {step.name}: python jobs/{step.job}.py ...")
        started = time.perf_counter()
        summary = run_step(step, done, out)
        if summary.get("error"):
            return {"job": "curriculum", "failed": step.name, "error": summary["error"],
                    "log": str(out / "logs" / f"{step.name}.log"), "done": sorted(done)}
        if step.name in TRAINING:
            summary["curriculum"] = link(config, step.name, summary, done)
        record.write_text(json.dumps(summary))
        done[step.name] = summary
        progress(f"[{n}/{len(chain)}] {step.name}: {headline(step.name, summary)} "
                 f"({time.perf_counter() - started:.0f} s)")
    fallback = not done.get("stage3", {}).get("accepted")
    return {"job": "curriculum", "error": None, "out": str(out),
            "stage4_data": "stage-2 corpus (stage 3 accepted no candidate)" if fallback else "stage-3 accepted rows",
            **{name: brief(name, summary) for name, summary in done.items()}}


def run_step(step: Step, done: dict[str, dict], out: Path) -> dict[str, Any]:
    """The step's job as its own process, its output in OUT/logs/<step>.log; its summary is its last stdout line."""
    (out / "logs").mkdir(exist_ok=True)
    log = out / "logs" / f"{step.name}.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
    with log.open("w") as handle:
        result = subprocess.run(step.command(done, out), stdout=subprocess.PIPE, stderr=handle, text=True, env=env,
                                cwd=out)
        handle.write(result.stdout)
    lines = result.stdout.strip().splitlines()
    try:
        summary = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        summary = {}
    if result.returncode != 0 or not summary:
        summary = {**summary, "error": summary.get("error") or f"exit status {result.returncode}: see {log}"}
    return summary


def link(config: CurriculumConfig, name: str, summary: dict, done: dict[str, dict]) -> dict[str, str]:
    """Tags the step's MLflow run with the curriculum and the run it started from; registers its export as a model
    version tagged with the version it started from."""
    # lazy: MLflow and torch (register_run loads them, ~15 s): --dry-run and the step lines start without them
    from mlflow.tracking import MlflowClient

    from pipelines.serving.register import register_run

    uri = resolve_tracking_uri(config.tracking_uri)
    client, run_id = MlflowClient(uri), summary.get("mlflow_run_id")
    previous = done.get(PREVIOUS.get(name, ""), {}).get("curriculum", {})
    tags = {"curriculum.out": str(Path(config.out).resolve()), "curriculum.step": name,
            **({"curriculum.previous_run_id": previous["run_id"]} if previous.get("run_id") else {})}
    if name == "stage4" and done.get("teacher", {}).get("mlflow_run_id"):
        tags["curriculum.teacher_run_id"] = done["teacher"]["mlflow_run_id"]
    linked = {"run_id": run_id or ""}
    if not run_id:
        return linked
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    if config.register:
        os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # the curriculum's console is its step lines
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # mlflow's advice on type hints and input examples
            version = register_run(run_id, tracking_uri=uri, name=config.model_name, alias=name)
        client.set_model_version_tag(config.model_name, version.version, "curriculum.step", name)
        if previous.get("version"):
            client.set_model_version_tag(config.model_name, version.version, "curriculum.previous_version",
                                         previous["version"])
        linked["version"] = str(version.version)
    return linked


HEADLINES = {"corpus0": ("rows",), "corpus2": ("rows",), "stage3": ("accepted", "rejected"),
             "stage4": ("kl_first", "kl_last", "student_val_loss", "baseline_val_loss")}


def brief(name: str, summary: dict) -> dict[str, Any]:
    """What the curriculum's summary line keeps of a step's."""
    keys = HEADLINES.get(name, ("val_loss", "no_memory_val_loss", "steps"))
    return {k: summary.get(k) for k in (*keys, "export", "mlflow_run_id", "curriculum") if k in summary}


def headline(name: str, summary: dict) -> str:
    """One progress line's worth: a corpus's rows per split, a stage's losses."""
    parts = []
    for key, value in brief(name, summary).items():
        if key not in HEADLINES.get(name, ("val_loss", "no_memory_val_loss", "steps")):
            continue
        if isinstance(value, dict):  # a corpus's rows by split and kind, a rejection count by reason
            value = ", ".join(f"{k} {sum(v.values()) if isinstance(v, dict) else v}" for k, v in value.items())
        parts.append(f"{key} {value:.3g}" if isinstance(value, float) else f"{key} {value}")
    return "  ".join(parts)


def plan(config: CurriculumConfig) -> str:
    """--dry-run: the commands, with the outputs of earlier steps named by placeholders."""
    placeholder = {name: {"export": f"<{name} export>", "mlflow_run_id": f"<{name} run>"} for name in TRAINING}
    out = Path(config.out).resolve()
    lines = [f"curriculum into {out}:"]
    for n, step in enumerate(steps(config), 1):
        if step.config is None:
            lines.append(f"{n}. {step.name}: python jobs/{step.job}.py {' '.join(step.args(placeholder))}")
            continue
        preset = flatten(dataclasses.asdict(PRESETS[step.job]))
        changed = {k: v for k, v in flatten(dataclasses.asdict(step.config(placeholder))).items() if preset[k] != v}
        lines.append(f"{n}. {step.name}: python jobs/{step.job}.py --config {step.config_file(out)}\n   "
                     f"its preset with {', '.join(f'{k}={v}' for k, v in changed.items())}")
    return "\n".join(lines)
