"""What every stage entry point does: config file + flags -> typed config -> one pipeline call -> a one-line JSON
summary as the last line of output."""

from __future__ import annotations

from pipelines.config import StageConfig, parse_config
from pipelines.stage import run_stage, shutdown_ray
from pipelines.tracking import summary_json


def run_job(argv: list[str] | None, default: StageConfig, description: str) -> int:
    config = parse_config(argv, default, description=description)
    summary = run_stage(config)
    shutdown_ray()  # flushes the workers' forwarded logs, so the summary is the last line
    print(summary_json(summary), flush=True)
    return 1 if summary.get("error") else 0
