"""Evaluate trained systems on the evaluation suites: the GCA model and its baselines, side by side.

    python jobs/evaluate.py --model outputs/ray/stage0-tiny/checkpoint_X/export --suite needle --out eval/
    python jobs/evaluate.py --model EXPORT_GCA EXPORT_IN_CONTEXT EXPORT_RAG EXPORT_NONE --suite needle,efficiency \\
        --out eval/
    python jobs/evaluate.py --model models:/awareness@candidate --suite needle --out eval/
    python jobs/evaluate.py --model EXPORT --suite code_qa --code_qa.corpus DIR --out eval/

Writes OUT/results.json ({"systems": {name: {"metrics": ..., "counts": ...}}}) and plots, logs them to MLflow, and
ends with a one-line JSON summary.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from pipelines.cli import ConfigError, parse_config
from pipelines.evaluate.job import EvaluateConfig, run_evaluation
from pipelines.tracking.tracker import summary_json


def dry_run(config: EvaluateConfig) -> str:
    return json.dumps({"evaluate": asdict(config), "suites": config.suites()}, indent=1)


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv, EvaluateConfig(), description=__doc__, on_dry_run=dry_run)
    try:
        summary = run_evaluation(config)
    except (FileNotFoundError, ConfigError) as error:
        print(f"evaluate: {error}", file=sys.stderr)
        print(summary_json({"job": "evaluate", "error": str(error)}), flush=True)
        return 2
    print(summary_json(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
