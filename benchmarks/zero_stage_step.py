"""The stage-0 job's step under each ZeRO stage: the whole job (Ray Train, 2 CPU workers over gloo, DeepSpeed)
trained --steps steps on the mixture with each stage in turns, --rounds times, so every stage sees the same load.
Prints each stage's seconds a step per round (the job's own `seconds_per_step`, the median of its last 100 steps:
start-up, evaluation and checkpointing excluded), their range and the ratio to the first stage.

    python benchmarks/zero_stage_step.py [--stages 2 0] [--steps 400] [--rounds 3] [-- JOB FLAGS ...]

JOB FLAGS go to jobs/stage0.py as given (e.g. the reading options of a documented command). The mixture starts at
step 0 (--needle.base_steps 0), so every timed step is a mixture step; evaluation and checkpoints only at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def job_command(stage: int, steps: int, storage: str, name: str, flags: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / "jobs" / "stage0.py"), *flags, "--needle.base_steps", "0",
            "--train.max_steps", str(steps), "--train.eval_every", str(steps), "--train.checkpoint_every", str(steps),
            "--deepspeed.zero_stage", str(stage), "--tracking.enabled", "false", "--run.storage_path", storage,
            "--run.name", name]


def seconds_per_step(command: list[str]) -> float:
    """The job's summary (its last line of output): median seconds a step."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    lines = done.stdout.strip().splitlines()
    summary = json.loads(lines[-1]) if lines else {}
    if done.returncode or summary.get("error"):
        raise RuntimeError(f"the job failed ({done.returncode}): {summary.get('error') or done.stderr[-2000:]}")
    return summary["seconds_per_step"]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(ours)
    times: dict[int, list[float]] = {stage: [] for stage in args.stages}
    with tempfile.TemporaryDirectory() as storage:
        for round_ in range(args.rounds):
            for stage in args.stages:
                name = f"zero{stage}-round{round_}"
                times[stage].append(seconds_per_step(job_command(stage, args.steps, storage, name, flags)))
                print(f"round {round_ + 1}: ZeRO-{stage} {times[stage][-1]:.4f} s a step", flush=True)
    first = args.stages[0]
    print(f"| ZeRO stage | s a step (rounds) | range | / ZeRO-{first} (per round) |")
    print("|---|---|---|---|")
    for stage in args.stages:
        ratios = [t / f for t, f in zip(times[stage], times[first], strict=True)]
        print(f"| {stage} | {' / '.join(f'{t:.3f}' for t in times[stage])} | {min(times[stage]):.3f}-"
              f"{max(times[stage]):.3f} | {min(ratios):.2f}-{max(ratios):.2f} |")
    print(json.dumps({f"zero{stage}_median_s": statistics.median(times[stage]) for stage in args.stages}))


if __name__ == "__main__":
    main()
