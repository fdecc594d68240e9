"""Every GPU check in one run on a GPU box (issue 28), under 9 minutes, writing one report file.

    python3 benchmarks/gpu_check.py --bundle .gpu-bundle --out REPORT_DIR     # on the GPU box, from the repo root
    python3 benchmarks/gpu_check.py --bundle .gpu-bundle --out REPORT_DIR --dry-run   # the steps and their limits
    python3 benchmarks/gpu_check.py --bundle .gpu-bundle --out REPORT_DIR --only "gpu tests"   # rerun one step

The box brings Python, a CUDA torch and most libraries; what it lacks (Ray, DeepSpeed, MLflow's client, the
transformers this project needs, ...) comes as wheels in the bundle `make gpu-check` assembles here
(benchmarks/gpu_bundle.py): its parts are joined, unpacked and installed with `pip install --no-index --no-deps
--target` into a directory put first on PYTHONPATH, so the box's own torch is used and nothing of the box changes.
Then, each step in a child process with its own time limit (one that hangs costs its limit, not the run):

1. the `gpu` tests (tests/gpu/: SDPA kernels against math, bf16 against fp32, Liger's kernels and compiled layers
   against eager, proto1 under zero.Init: memory against the plan, training steps);
2. benchmarks/gpu_mfu.py's lever table (eager, Liger, compile, both) of proto1's training step, with a profile of
   one step's top operators; then the scale pair and the prod pair's real shapes truncated to 8 layers (eager and
   both): tokens/s, MFU and peak memory, every ratio from one card.

The second call (`--only "stage2 corpus" --only "stage2 proto1 50 steps" --only "mfu proto1 stage shape" --only
"ttft 16k 64k"`; named steps run in the order named): a 50-step stage-2 run of proto1 (random weights, bf16
checkpoints) through Ray Train on one GPU: NCCL, bf16, the ZeRO stage the memory plan chooses, on a corpus of random
rows of 2048 tokens and 16 x 512 memory tokens; the bare step at the job's 4 rows beside it; then the efficiency
suite's time to first token at 16k and 64k memory tokens (pipelines.evaluate.efficiency) on its export.

Two serving steps run only when named (`--only "serve demo" --only "serve proto1"`; with the four above they would
not fit one device command): benchmarks/serve_load.py with a GPU replica (`num_gpus: 1`, bf16, --serve-only: the box
has no MLflow server) over the export the bundle carries (`gpu_bundle.py --export`, a trained `make demo` export) or
the tiny random one, and over proto1 (random weights, the 0.6B pair) at levels 1, 4, 16: requests/s, TTFT and
whether every answer equals the pyfunc's in the same process.

REPORT_DIR/gpu-check-report.md gets each step's command, status, seconds and output tail, and the versions seen;
REPORT_DIR/<step>.log each step's whole output.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path("/tmp/awareness-gpu-check")
SITE, WHEELS, CHECKPOINTS = WORK / "site", WORK / "wheels", WORK / "checkpoints"
BUDGET_S = 540  # the whole run, install included: under the device's 10-minute command limit with room to report
QLORA_TESTS = "tests/gpu/test_qlora_scale_gpu.py"
# pipelines.train.hooks.HOOK_ENV and pipelines.train.profiling's STEPS_ENV and OUT_ENV (a test holds them equal): this
# script starts on the box before the bundle is installed, so it imports nothing of the project
HOOK_ENV = "AWARENESS_TRAIN_HOOK"
PROFILE_STEPS_ENV, PROFILE_OUT_ENV = "AWARENESS_PROFILE_STEPS", "AWARENESS_PROFILE_OUT"
TAIL = 6000  # characters of each step's output kept in the report


@dataclass
class Step:
    name: str
    command: list[str]
    limit_s: int
    default: bool = True  # run without --only; the rest only when named
    env: dict[str, str] = field(default_factory=dict)  # set for this step only


def steps(python: str, bundle: Path = ROOT / ".gpu-bundle", out: Path = WORK) -> list[Step]:
    """The steps in plan order; `out` is where a step's own files go (the report's folder)."""
    stage2 = WORK / "stage2"
    # the serving steps: benchmarks/serve_load.py with a GPU replica; its table and JSON summary end the output
    serve = [python, "benchmarks/serve_load.py", "--device", "cuda", "--dtype", "bfloat16", "--serve-only",
             "--threads", "4"]
    pytest = [python, "-m", "pytest", "-m", "gpu", "-q", "-s", "-p", "no:cacheprovider",
              "-o", "addopts=-ra --strict-markers --durations=10"]
    return [
        Step("versions", [python, "-c", VERSIONS], 20),
        Step("gpu tests", pytest + ["tests/gpu", "--ignore", QLORA_TESTS], 160),
        # Liger's kernels and the compiled layers against eager: the part of the gpu tests the levers below rely on
        Step("fused kernel tests", pytest + ["tests/gpu/test_fused_kernels_gpu.py"], 120, default=False),
        # the training step's levers (eager, Liger, compile, both) on proto1 with a profile of one step, then the
        # scale pair and the prod pair's real shapes (8 of its 48 layers fit one GPU), eager and Liger (the stage
        # jobs' default; compiled layers recompile per GCA block at these sizes): every ratio from one card
        Step("mfu proto1 levers", [python, "benchmarks/gpu_mfu.py", "--max-micro-batch", "16", "--repeats", "3",
                                   "--warmup", "2", "--profile", str(WORK / "proto1-step-profile.txt")], 130),
        # the bare step at the stage job's own shape (4 rows a step, as "stage2 proto1 50 steps" runs): the step the
        # job's step is compared with; beside it the same ids packed 4 examples a row, what masked attention costs
        Step("mfu proto1 stage shape", [python, "benchmarks/gpu_mfu.py", "--micro-batch", "4", "--repeats", "5",
                                        "--warmup", "2", "--levers", "eager", "liger", "--packed", "4",
                                        "--no-flop-check"], 100, default=False),
        Step("mfu scale", [python, "benchmarks/gpu_mfu.py", "--pair", "scale", "--max-micro-batch", "4",
                           "--repeats", "3", "--warmup", "2", "--levers", "eager", "liger", "--no-flop-check"], 100),
        # the seed's QLoRA plan: the scale pair with an NF4 base and 8-bit AdamW against the plan and a 40 GiB card,
        # then in bf16 for the tokens/s beside it (31 GiB of bf16 checkpoints written first)
        Step("qlora scale", pytest + [QLORA_TESTS], 240, default=False),
        # micro-batch 8 fixed (it fits: the eager row ran there), not found by doubling
        Step("mfu prod 8 layers", [python, "benchmarks/gpu_mfu.py", "--pair", "prod", "--layers", "8",
                                   "--micro-batch", "8", "--repeats", "3", "--warmup", "2", "--levers", "eager",
                                   "liger", "--no-flop-check"], 130),
        Step("stage2 corpus", [python, "-c", CORPUS.format(out=str(stage2 / "corpus"))], 150, default=False),
        Step("stage2 proto1 50 steps", [
            python, "jobs/stage2.py", "--model.pair", "proto1", "--model.checkpoint_root", str(CHECKPOINTS),
            "--scaling.use_gpu", "true", "--scaling.num_workers", "1", "--scaling.gpus_per_node", "1",
            "--scaling.cpus_per_worker", "4", "--deepspeed.precision", "bf16", "--deepspeed.zero_stage", "none",
            "--data.train_path", str(stage2 / "corpus" / "train"), "--data.val_path", str(stage2 / "corpus" / "val"),
            "--data.max_tokens", "2048", "--data.max_chunks", "16", "--data.chunk_len", "512",
            "--data.val_examples", "8", "--train.max_steps", "50", "--train.memories_per_step", "4",
            "--train.log_every", "10", "--train.eval_every", "50", "--train.checkpoint_every", "50",
            "--run.storage_path", str(stage2 / "ray"), "--run.name", "gpu-check", "--tracking.enabled", "false"],
            210, default=False,
            # where the job's step goes beyond the bare step's: steps 21-25 profiled on the worker, its table a file
            env={HOOK_ENV: "pipelines.train.profiling:profile_steps", PROFILE_STEPS_ENV: "20:25",
                 PROFILE_OUT_ENV: str(out / "stage2-step-profile.txt")}),
        Step("ttft 16k 64k", [python, "-c", TTFT.format(runs=str(stage2 / "ray" / "gpu-check"),
                                                       root=str(CHECKPOINTS))], 60, default=False),
        Step("serve demo", [python, "-c", SERVE_DEMO.format(bundle=str(bundle), work=str(WORK), serve=serve)], 170,
             default=False),
        Step("serve proto1", [python, "-c", SERVE_PROTO1.format(root=str(CHECKPOINTS), work=str(WORK), serve=serve)],
             230, default=False),
    ]


def steps_to_run(plan: list[Step], only: list[str]) -> list[Step]:
    """The steps named by --only, in the order named (what matters most first, so a short budget cuts the rest);
    without --only, the default ones in plan order."""
    by_name = {s.name: s for s in plan}
    return [by_name[name] for name in dict.fromkeys(only)] if only else [s for s in plan if s.default]


VERSIONS = """
import json, subprocess, sys, torch, transformers, deepspeed, ray
print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                  "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                  "transformers": transformers.__version__, "deepspeed": deepspeed.__version__,
                  "ray": ray.__version__}))
print(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
"""

CORPUS = """
import torch
from models import PAIRS, write_random_checkpoints
from pipelines.corpora.random_rows import write_random_corpus
write_random_checkpoints(PAIRS["proto1"], "{root}", dtype=torch.bfloat16)
print(write_random_corpus("{out}", rows=64, val_rows=8, max_tokens=2048, chunks=16, chunk_len=512, vocab=151669))
""".replace("{root}", str(CHECKPOINTS))

TTFT = """
import json, pathlib, torch
from models import AwarenessModel
from pipelines.evaluate.common import load_system
from pipelines.evaluate.efficiency import efficiency_row
exports = sorted(pathlib.Path("{runs}").glob("checkpoint_*/export"))
if exports:
    export = str(exports[-1])
else:  # stage 2 left no export: proto1 with its GCA blocks as built (gates at 0 read the memory all the same)
    export = "/tmp/awareness-gpu-check/proto1-export"
    AwarenessModel.from_pretrained_pair("{root}/Qwen3-0.6B", "{root}/Qwen3-Embedding-0.6B").save_pretrained(export)
system = load_system("gca", export, {{"memory": "gca", "needle": {{"chunk_len": 512}}}}, "cuda")
print("export", export, "dtype", next(system.model.parameters()).dtype)
for tokens in (16384, 65536):
    print(json.dumps(efficiency_row(system, tokens, decode_tokens=16, repeats=3)))
"""

SERVE_DEMO = """
import shutil, subprocess, sys, pathlib
bundled, work = pathlib.Path({bundle!r}) / "export", pathlib.Path({work!r}) / "serve-demo"
model = []
if bundled.is_dir():  # its config names the base checkpoints beside it (gpu_bundle.bundle_export)
    shutil.copytree(bundled, work, dirs_exist_ok=True)
    model = ["--model", str(work / "export")]
print("serving", model[1] if model else "the tiny random export (the bundle carries no trained export)", flush=True)
sys.exit(subprocess.run({serve!r} + model + ["--levels", "1", "4", "16", "64", "--requests", "192",
                                              "--time-limit", "15"]).returncode)
"""

SERVE_PROTO1 = """
import pathlib, subprocess, sys, torch
from models import PAIRS, AwarenessModel, write_random_checkpoints
root, export = pathlib.Path({root!r}), pathlib.Path({work!r}) / "serve-proto1"
if not (root / "Qwen3-0.6B").is_dir():
    write_random_checkpoints(PAIRS["proto1"], root, dtype=torch.bfloat16)
if not export.is_dir():  # proto1 with its GCA blocks as built (random weights: noise for answers, a real cost)
    AwarenessModel.from_pretrained_pair(root / "Qwen3-0.6B", root / "Qwen3-Embedding-0.6B").save_pretrained(export)
sys.exit(subprocess.run({serve!r} + ["--model", str(export), "--levels", "1", "4", "16", "--requests", "48",
                                     "--time-limit", "15"]).returncode)
"""


def install(bundle: Path) -> str:
    """The bundle's parts joined and unpacked, its wheels installed into SITE; the pip output."""
    parts = sorted(bundle.glob("bundle.tar.xz.part*"))
    if not parts:
        raise SystemExit(f"{bundle}: no bundle.tar.xz.part* (run `make gpu-check` on the CPU machine first)")
    WHEELS.mkdir(parents=True, exist_ok=True)
    join = " ".join(shlex.quote(str(p)) for p in parts)
    subprocess.run(f"cat {join} | tar -xJ -C {shlex.quote(str(WHEELS))}", shell=True, check=True)
    wheels = sorted(str(w) for w in WHEELS.glob("*.whl"))
    result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                             "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels],
                            capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"pip install failed:\n{result.stdout}\n{result.stderr}")
    return f"{len(wheels)} wheels installed into {SITE}"


def run_step(step: Step, env: dict[str, str], deadline: float, log_dir: Path) -> dict:
    limit = max(1, min(step.limit_s, int(deadline - time.monotonic())))
    started = time.monotonic()
    try:
        result = subprocess.run(step.command, cwd=ROOT, env=env | step.env, capture_output=True, text=True,
                                timeout=limit)
        status, output = ("passed" if result.returncode == 0 else f"failed (exit {result.returncode})",
                          result.stdout + result.stderr)
    except subprocess.TimeoutExpired as error:
        status = f"timed out after {limit} s"
        output = (error.stdout or b"").decode(errors="replace") + (error.stderr or b"").decode(errors="replace")
    (log_dir / f"{slug(step.name)}.log").write_text(output)  # the whole output: the report keeps its tail
    return {"name": step.name, "status": status, "seconds": round(time.monotonic() - started, 1),
            "command": shlex.join(step.command), "tail": output[-TAIL:]}


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name)


def report(results: list[dict], out: Path) -> Path:
    lines = ["# gpu-check report", "", "| step | status | seconds |", "|---|---|---|"]
    lines += [f"| {r['name']} | {r['status']} | {r['seconds']} |" for r in results]
    for r in results:
        lines += ["", f"## {r['name']}: {r['status']}", "", f"`{r['command']}`", "", "```", r["tail"], "```"]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "gpu-check-report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=ROOT / ".gpu-bundle", help="what make gpu-check assembled")
    parser.add_argument("--out", type=Path, required=True, help="where gpu-check-report.md is written")
    parser.add_argument("--budget", type=int, default=BUDGET_S, help="seconds for the whole run, install included")
    parser.add_argument("--dry-run", action="store_true", help="print the steps and their time limits, run nothing")
    parser.add_argument("--only", action="append", default=[], metavar="STEP",
                        help="run only this step (repeatable; a step's name as --dry-run prints it)")
    args = parser.parse_args()
    plan = steps(sys.executable, args.bundle.resolve(), args.out.resolve())
    unknown = sorted(set(args.only) - {s.name for s in plan})
    if unknown:
        parser.error(f"--only {unknown[0]!r}: not a step; the steps: {', '.join(s.name for s in plan)}")
    plan = steps_to_run(plan, args.only)
    if args.dry_run:
        for step in plan:
            print(f"{step.limit_s:4d} s  {step.name}: {shlex.join(step.command)[:160]}".replace("\n", " "))
        print(f"{sum(s.limit_s for s in plan)} s of step limits; the whole run stops at {args.budget} s")
        return
    deadline = time.monotonic() + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    results = [{"name": "install", "status": "passed", "seconds": 0.0, "command": f"install {args.bundle}",
                "tail": install(args.bundle)}]
    results[0]["seconds"] = round(time.monotonic() - started, 1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT)]), "PYTHONUNBUFFERED": "1",
           "AWARENESS_GPU_CHECKPOINTS": str(CHECKPOINTS), "TOKENIZERS_PARALLELISM": "false",
           "DS_ACCELERATOR": "cuda"}  # the DeepSpeed wheel was built on a CPU machine: name the accelerator
    for step in plan:
        if time.monotonic() >= deadline:
            results.append({"name": step.name, "status": "not run (out of time)", "seconds": 0.0,
                            "command": shlex.join(step.command), "tail": ""})
            continue
        results.append(run_step(step, env, deadline, args.out))
        print(json.dumps({k: results[-1][k] for k in ("name", "status", "seconds")}), flush=True)
    print(f"report: {report(results, args.out)}")


if __name__ == "__main__":
    main()
