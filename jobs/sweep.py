"""Sweep LoRA rank x GCA placement x learning rate with Ray Tune (ASHA on validation loss); register the best.

    python jobs/sweep.py --pair tiny --stage 0 --num-samples 8
    python jobs/sweep.py --pair tiny --num-samples 2 --ranks 8 16 --placements upper_half "1,3" --train.max_steps 40
    python jobs/sweep.py --stage 1 --data.train_path corpus/train --data.val_path corpus/val --num-samples 4
    ray job submit --working-dir . -- python jobs/sweep.py --pair proto1 --scaling.use_gpu true --scaling.num_workers 2

Stage 0 ranks trials on the needle validation loss; stages 1-2 start from jobs/stage1.py / stage2.py's defaults
(pair tiny-text), train on the commit shards jobs/build_corpus.py --stage 2 writes, and rank on their val_loss.
Any stage-config field is an override for every trial (--section.field VALUE, see jobs/stage0.py --help).
Prints the rank x placement table, then a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from pipelines.cli import parse_config
from pipelines.train.driver import shutdown_ray
from pipelines.tracking.tracker import summary_json
from pipelines.tune.sweep import SweepConfig, default_base, run_sweep


def parse(argv: list[str] | None) -> tuple[SweepConfig, list[str], str | None, int]:
    d = SweepConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", help="default: tiny for stage 0, the stage job's pair (tiny-text) for stages 1-2")
    p.add_argument("--stage", type=int, default=0, choices=[0, 1, 2])
    p.add_argument("--num-samples", type=int, default=d.num_samples)
    p.add_argument("--ranks", type=int, nargs="+", default=d.lora_ranks)
    p.add_argument("--placements", nargs="+", help="default: upper_third upper_half every_k:4 last:4 MID,LAST")
    p.add_argument("--lr-min", type=float, default=d.lr_min)
    p.add_argument("--lr-max", type=float, default=d.lr_max)
    p.add_argument("--grace-period", type=int, default=d.grace_period, help="evaluations before ASHA may stop a trial")
    p.add_argument("--max-concurrent", type=int, default=d.max_concurrent, help="0: as many as the cluster holds")
    p.add_argument("--trial-cpus", type=float, default=d.trial_cpus)
    p.add_argument("--data-cpus", type=float, default=d.data_cpus, help="CPUs kept free for Ray Data (corpus stages)")
    p.add_argument("--name", default=d.name)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--registered-model", default=d.registered_model, help="registered model name")
    p.add_argument("--no-register", action="store_true", help="do not register the best trial")
    args, rest = p.parse_known_args(argv)
    sweep = SweepConfig(name=args.name, num_samples=args.num_samples, lora_ranks=args.ranks,
                        placements=args.placements, lr_min=args.lr_min, lr_max=args.lr_max,
                        grace_period=args.grace_period, trial_cpus=args.trial_cpus, data_cpus=args.data_cpus,
                        max_concurrent=args.max_concurrent,
                        seed=args.seed, registered_model=None if args.no_register else args.registered_model)
    return sweep, rest, args.pair, args.stage


def main(argv: list[str] | None = None) -> dict:
    sweep, rest, pair, stage = parse(argv)
    try:
        base = parse_config(rest, default_base(pair, stage), description="stage-config overrides for every trial")
    except ValueError as error:  # an unusable pair, or a config problem (e.g. no corpus for stage 1-2)
        raise SystemExit(f"sweep: {error}") from error
    base = dataclasses.replace(base, run=dataclasses.replace(base.run, name=sweep.name))
    problems = sweep.problems(base)
    if problems:
        raise SystemExit("sweep: invalid sweep:\n  - " + "\n  - ".join(problems))
    summary = run_sweep(sweep, base)
    shutdown_ray()
    print(summary_json(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["best"] else 1)
