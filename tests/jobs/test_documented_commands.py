"""Every command the documentation shows runs: each `python jobs/NAME.py ...` in README.md, docs/*.md, the measured
results in docs/results/*.md, the Makefile, cluster.yaml (its comments) and the jobs' docstrings, with placeholders
(corpus paths, exports, checkpoint roots, sources) replaced by test paths that exist. The training jobs and the sweep
dry-run through their own entry points (validation and the memory plan must pass; a GPU command's plan must fit),
jobs/plan.py runs for real, the others parse and validate (build_corpus and encode_memory check their sources
exist). The issue's must-show command runs as a process. The `ray`, `hf` and `mlflow` commands shown beside them use
only flags their own --help lists."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "Makefile", ROOT / "cluster.yaml", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "docs" / "results").glob("*.md")), *sorted((ROOT / "jobs").glob("*.py"))]
TRAINING_JOBS = ("stage0", "beyond_lexical", "stage1", "stage2", "stage4", "encoder_ul2", "traffic_vlm", "retriever",
                 "sweep")
# The command the issue asks to show: prod on 2 nodes x 8 GPUs plans and fits.
MUST_SHOW = ["--model.pair", "prod", "--scaling.use_gpu", "true", "--scaling.num_workers", "16",
             "--data.train_path", "C/train", "--data.val_path", "C/val", "--dry-run"]
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_0-9]*\b|\.\.\.")  # VALUE, FILE, DIR, N, RUN_ID, ...


@dataclass
class Command:
    where: str  # file:line
    job: str
    args: list[str]


def _text(path: Path) -> str:
    return path.read_text().replace("\\\\\n", " ").replace("\\\n", " ")


def _optional_parts(rest: str) -> str:
    """`[--gate 0.5]` is kept as flags; `[--max_commits N]`, `[--section.field VALUE ...]` are dropped."""
    return re.sub(r"\[([^\]]*)\]", lambda m: "" if PLACEHOLDER.search(m.group(1)) else m.group(1), rest)


def documented_commands() -> list[Command]:
    commands = []
    for path in DOCUMENTS:
        text = _text(path)
        for match in re.finditer(r"python jobs/(\w+)\.py([^\n`#(]*)", text):
            rest = _optional_parts(match.group(2)).replace("...", "")
            line = text[: match.start()].count("\n") + 1
            commands.append(Command(f"{path.relative_to(ROOT)}:{line}", match.group(1), shlex.split(rest)))
    return commands


@dataclass
class DocPaths:
    """Real stand-ins for what the documented commands name."""

    root: Path
    checkpoint_root: Path

    def __post_init__(self) -> None:
        for split in ("train", "val"):
            (self.corpus / split).mkdir(parents=True, exist_ok=True)
        self.export.mkdir(parents=True, exist_ok=True)
        (self.export / "awareness.safetensors").write_bytes(b"")  # init_from only has to name an export
        self.teacher.mkdir(parents=True, exist_ok=True)  # a stage-4 teacher: an export that reads its prompt
        (self.teacher / "awareness_config.json").write_text("{}")
        (self.teacher / "system.json").write_text('{"memory": "in_context"}')
        (self.export / "awareness_config.json").write_text("{}")  # and stage 3's teacher, to look like one
        self.retriever.mkdir(parents=True, exist_ok=True)  # a dense_rag reader's retriever export
        (self.retriever / "retriever.json").write_text("{}")
        self.qwen3.mkdir(parents=True, exist_ok=True)
        (self.qwen3 / "config.json").write_text("{}")
        self.siglip.mkdir(parents=True, exist_ok=True)
        (self.siglip / "config.json").write_text('{"model_type": "siglip_vision_model", "image_size": 224}')
        self.sources.mkdir(parents=True, exist_ok=True)
        (self.sources / "module.py").write_text("def f(x):\n    return x\n")
        subprocess.run(["git", "init", "-q", str(self.sources)], check=True)  # the curriculum mines its history
        (self.root / "my.yaml").write_text("train:\n  max_steps: 5\n")
        (self.root / "ul2.yaml").write_text("train:\n  max_steps: 5\n")
        (self.root / "config.yaml").write_text("train:\n  max_steps: 100\n")  # --config FILE: long enough to sweep

    corpus = property(lambda self: self.root / "C")
    export = property(lambda self: self.root / "export")
    teacher = property(lambda self: self.root / "teacher")
    retriever = property(lambda self: self.root / "retriever")
    qwen3 = property(lambda self: self.root / "Qwen3-0.6B")
    siglip = property(lambda self: self.root / "siglip-base-patch16-224")
    sources = property(lambda self: self.root / "repo")

    def flags(self) -> dict[str, str]:
        return {"--data.train_path": str(self.corpus / "train"), "--data.val_path": str(self.corpus / "val"),
                "--model.init_from": str(self.export), "--distill.teacher": str(self.teacher),
                "--model.retriever": str(self.retriever),
                "--model_dir": str(self.export),
                "--model.encoder_checkpoint": str(self.qwen3), "--model.checkpoint": str(self.qwen3),
                "--model.vision_path": str(self.siglip), "--model.checkpoint_root": str(self.checkpoint_root),
                "--checkpoint_root": str(self.checkpoint_root),
                "--run.storage_path": str(self.root / "ray"), "--out": str(self.root / "out"),
                "--sources": str(self.sources), "--data.paths": str(self.sources), "--commits.corpus": str(self.corpus),
                "--corpus": str(self.corpus), "--teacher": str(self.export), "--config": str(self.root / "config.yaml")}


def with_test_paths(args: list[str], paths: DocPaths) -> list[str]:
    """Each path-valued flag's value (all of a list flag's values) replaced by its stand-in."""
    replace, out, i = paths.flags(), [], 0
    while i < len(args):
        out.append(args[i])
        if args[i] in replace:
            out.append(replace[args[i]])
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                i += 1
            continue
        i += 1
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory, checkpoint_root) -> DocPaths:
    return DocPaths(tmp_path_factory.mktemp("documented"), checkpoint_root)


@pytest.fixture
def planned_once(monkeypatch):
    """The memory plan counts a pair's parameters on the meta device (seconds for prod); the documented commands
    plan the same few pairs many times, so the counts are computed once per (pair, train modes, LoRA)."""
    from pipelines.train import plan

    original, counted = plan.count_parameters, {}

    def cached(inputs):
        key = (inputs.pair, inputs.decoder, inputs.encoder, inputs.lora_rank, tuple(inputs.lora_targets))
        if key not in counted:
            counted[key] = original(inputs)
        return counted[key]

    monkeypatch.setattr(plan, "count_parameters", cached)


def dry_run(job: str, args: list[str], capsys) -> str:
    """The job's own entry (run_job for the stage and UL2 jobs, jobs/sweep.py's main) with --dry-run: it must exit 0
    from the dry run, before any Ray or DeepSpeed start. Returns what it printed."""
    from pipelines.train.job import run_job
    from pipelines.train.presets import (BEYOND_LEXICAL, ENCODER_UL2, RETRIEVER, STAGE0, STAGE1, STAGE2, STAGE4,
                                          TRAFFIC_VLM)

    args = args if "--dry-run" in args else [*args, "--dry-run"]
    with pytest.raises(SystemExit) as exit:
        if job == "sweep":
            import jobs.sweep

            jobs.sweep.main(args)
        else:
            run_job(args, {"stage0": STAGE0, "beyond_lexical": BEYOND_LEXICAL, "stage1": STAGE1, "stage2": STAGE2,
                           "stage4": STAGE4, "encoder_ul2": ENCODER_UL2, "traffic_vlm": TRAFFIC_VLM,
                           "retriever": RETRIEVER}[job], "")
    out, err = capsys.readouterr()
    assert exit.value.code == 0, err
    return out


def check(command: Command, paths: DocPaths, capsys) -> None:
    from pipelines.cli import parse_config

    args = with_test_paths(command.args, paths)
    capsys.readouterr()  # only this command's output
    if command.job in TRAINING_JOBS:
        out = dry_run(command.job, args, capsys)
        assert out.startswith("# resolved config"), out[:500]
        if command.job == "traffic_vlm":
            assert "# model\nvision tokens: 196" in out, out[-2000:]
        elif command.job not in ("encoder_ul2", "retriever"):
            assert "# memory plan" in out and "does NOT fit" not in out, out[-2000:]
    elif command.job == "curriculum":  # its dry run prints the chain of job commands, nothing runs
        import jobs.curriculum

        with pytest.raises(SystemExit) as exit:
            jobs.curriculum.main([*args, "--dry-run"] if "--dry-run" not in args else args)
        out = capsys.readouterr().out
        assert exit.value.code == 0 and out.startswith("curriculum into") and "jobs/stage4.py" in out, out[-2000:]
    elif command.job == "plan":
        import jobs.plan

        assert jobs.plan.main(args) == 0, capsys.readouterr().out[-2000:]  # 0: it fits
    else:
        from jobs.build_corpus import BuildJob
        from jobs.generate import GenerateArgs
        from jobs.register import RegisterArgs
        from jobs.stage3_data import Stage3Job
        from pipelines.evaluate.job import EvaluateConfig
        from pipelines.memory.encoding import EncodeMemoryConfig

        default = {"build_corpus": BuildJob(), "generate": GenerateArgs(), "register": RegisterArgs(),
                   "evaluate": EvaluateConfig(), "encode_memory": EncodeMemoryConfig(),
                   "stage3_data": Stage3Job()}[command.job]
        parse_config(args, default)  # exits 2 with the problem on stderr when the command is wrong


def test_every_documented_job_command_runs(paths, planned_once, capsys, monkeypatch):
    commands = documented_commands()
    jobs_shown = {c.job for c in commands}
    assert jobs_shown == {p.stem for p in (ROOT / "jobs").glob("*.py")} - {"__init__"}, jobs_shown
    assert any(c.where.startswith("cluster.yaml") and c.job == "stage2" for c in commands)
    monkeypatch.chdir(paths.root)
    for command in commands:
        try:
            check(command, paths, capsys)
        except BaseException as error:  # which documented command, not just the assertion
            raise AssertionError(f"{command.where}: python jobs/{command.job}.py {shlex.join(command.args)}: "
                                 f"{error!r}\n{capsys.readouterr().err[-2000:]}") from error


def test_the_issue_must_show_prod_on_16_gpus_dry_runs_and_fits(paths):
    """As a process, as a user runs it (the other commands run in this process, through the same entry points)."""
    result = subprocess.run([sys.executable, str(ROOT / "jobs" / "stage2.py"), *MUST_SHOW], cwd=paths.root,
                            capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "pair prod: 2 node(s) x 8 GPU(s) of 80 GiB" in result.stdout and "\nfits: " in result.stdout


# ---------------------------------------------------------------------------------------------- ray, hf, mlflow
TOOLS = ("ray job submit", "ray up", "ray down", "ray exec", "ray attach", "ray dashboard", "hf download",
         "mlflow server", "mlflow ui", "mlflow models serve", "serve run", "serve deploy")


def tool_commands() -> dict[str, set[str]]:
    """The flags each documented `ray ...`, `hf download` or `mlflow ...` command uses (those of a job after `--`
    belong to the job)."""
    used: dict[str, set[str]] = {}
    pattern = re.compile(r"(?:^|(?<=[\s`'(#/]))(" + "|".join(map(re.escape, TOOLS)) + r")\b([^\n`#]*)")
    for path in DOCUMENTS:
        text = _text(path)
        for start in range(len(text)):  # overlapping: `ray exec cluster.yaml 'hf download ...'` holds two
            if not (match := pattern.match(text, start)):
                continue
            tool, rest = match.group(1), re.split(r" -- |'", match.group(2))[0]  # a quote ends ray exec's own flags
            used.setdefault(tool, set()).update(re.findall(r"(?<!\S)(--?[a-zA-Z][\w-]*)", rest))
    return used


def cli_flags(tool: str) -> set[str]:
    """Every option of a documented ray, serve or mlflow command, read from its click command in this process: what
    `TOOL --help` lists, without a CLI process (seconds of imports) for each."""
    import click
    from mlflow.cli import cli as mlflow_cli
    from ray.scripts.scripts import cli as ray_cli
    from ray.serve.scripts import cli as serve_cli

    program, *path = tool.split()
    command = {"ray": ray_cli, "serve": serve_cli, "mlflow": mlflow_cli}[program]
    for name in path:
        command = command.get_command(click.Context(command), name)
        assert command is not None, f"{program} has no command {name!r}"
    params = command.get_params(click.Context(command))
    return {flag for param in params for flag in (*param.opts, *param.secondary_opts)}


def help_flags(tool: str) -> set[str]:
    """The options `TOOL --help` prints (hf imports each command's options only when the command runs)."""
    program, *sub = tool.split()
    result = subprocess.run([str(Path(sys.executable).parent / program), *sub, "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, (tool, result.stderr[-1000:])
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", result.stdout))


def test_every_documented_ray_hf_and_mlflow_flag_exists():
    used = tool_commands()
    assert {"ray job submit", "ray up", "ray exec", "ray dashboard", "ray attach", "hf download",
            "mlflow server", "mlflow models serve", "serve run", "serve deploy"} <= set(used), used
    for tool, flags in sorted(used.items()):
        missing = flags - (help_flags(tool) if tool.startswith("hf ") else cli_flags(tool))
        assert not missing, f"{tool} has no {sorted(missing)}"
