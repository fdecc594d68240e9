"""Per-GPU memory plan for training a pair, before spending cluster time.

    python jobs/plan.py --pair prod --nodes 2 --gpus_per_node 8 [--lora_rank 64] [--offload_optimizer true]
    python jobs/plan.py --pair prod --nodes 2 --gpus_per_node 8 --lora_targets q_proj k_proj v_proj o_proj experts \\
        --gradient_checkpointing true
    python jobs/plan.py --pair scale --gpus_per_node 1 --gpu_memory_gib 40 --quantize nf4 --optimizer adamw_8bit

Prints the plan, then a one-line JSON summary; exits 1 when it does not fit.
"""

from __future__ import annotations

import json
import sys

from pipelines.cli import parse_config
from pipelines.train.plan import PlanInput, plan_memory


def main(argv: list[str] | None = None) -> int:
    plan = plan_memory(parse_config(argv, PlanInput(), description=__doc__))
    print(plan.table())
    print(json.dumps({"job": "plan", "pair": plan.inputs.pair, "gpus": plan.inputs.nodes * plan.inputs.gpus_per_node,
                      "gib_per_gpu": round(plan.total_gib, 2),
                      "load_gib_per_gpu": round(plan.load_gib, 2), "fits": plan.fits}))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
