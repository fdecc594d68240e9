"""Sweep LoRA rank x GCA placement x learning rate with Ray Tune (ASHA on validation loss); register the best.

    python jobs/sweep.py --stage 0 --sweep.num_samples 8
    python jobs/sweep.py --sweep.num_samples 2 --sweep.lora_ranks 8 16 --sweep.placements upper_half 1,3 \\
        --train.max_steps 40 --train.eval_every 20
    python jobs/sweep.py --stage 1 --data.train_path corpus/train --data.val_path corpus/val --sweep.num_samples 4
    python jobs/sweep.py --stage 1 --data.train_path corpus/train --data.val_path corpus/val --dry-run
    ray job submit --working-dir . -- python jobs/sweep.py --model.pair proto1 --scaling.use_gpu true \\
        --scaling.num_workers 2

`--stage` picks the trials' preset: stage 0 the tiny pair on needles; stages 1-2 jobs/stage1.py / stage2.py's
defaults (pair tiny-text), trained on the commit shards jobs/build_corpus.py --stage 2 writes, ranked on val_loss.
Every other stage-config field (--section.field VALUE) is the same for every trial; --sweep.* is the search.
Prints the rank x placement table, then a one-line JSON summary.
"""

from __future__ import annotations

import sys

from pipelines.cli import parse_config, peek
from pipelines.tracking.tracker import summary_json
from pipelines.train.driver import shutdown_ray
from pipelines.train.job import dry_run_report
from pipelines.tune.sweep import SweepJob, run_sweep


def main(argv: list[str] | None = None) -> dict:
    stage = peek(argv, "stage", 0)
    job = parse_config(argv, SweepJob.for_stage(stage if stage in (0, 1, 2) else 0), description=__doc__,
                       on_dry_run=lambda config: dry_run_report(config.base()))
    summary = run_sweep(job.sweep, job.base())
    shutdown_ray()
    print(summary_json(summary), flush=True)
    return summary


if __name__ == "__main__":
    sys.exit(0 if main()["best"] else 1)
