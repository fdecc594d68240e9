"""Per-GPU memory plan for training a pair, before spending cluster time.

    python jobs/plan.py --pair prod --nodes 2 --gpus-per-node 8 [--lora-rank 64] [--offload-optimizer]

Prints the plan, then a one-line JSON summary; exits 1 when it does not fit.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

from pipelines.train.plan import PlanInput, plan_memory


def parse_args(argv: list[str] | None = None) -> PlanInput:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(PlanInput):
        flag = f"--{f.name.replace('_', '-')}"
        if f.name == "pair":
            parser.add_argument(flag, required=True)
        elif isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif isinstance(f.default, tuple):
            parser.add_argument(flag, default=",".join(f.default), type=lambda v: tuple(v.split(",")))
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default)
    return PlanInput(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    plan = plan_memory(parse_args(argv))
    print(plan.table())
    print(json.dumps({"job": "plan", "pair": plan.inputs.pair, "gpus": plan.inputs.nodes * plan.inputs.gpus_per_node,
                      "gib_per_gpu": round(plan.total_gib, 2), "fits": plan.fits}))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
