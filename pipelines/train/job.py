"""What every training job's entry point does: command line -> typed config (or --dry-run) -> one run -> a one-line
JSON summary as the last line of output. Parsing comes first and imports neither Ray Train nor DeepSpeed, so --help,
--dry-run and a wrong flag answer in seconds with nothing but their own lines."""

from __future__ import annotations

import sys

from pipelines.cli import parse_config
from pipelines.tracking.tracker import resolve_tracking_uri, summary_json
from pipelines.train.config import StageConfig, Ul2Config
from pipelines.train.plan import dry_run_report


def run_job(argv: list[str] | None, default: StageConfig | Ul2Config, description: str) -> int:
    config = parse_config(argv, default, description=description, on_dry_run=dry_run_report)
    # Ray Train and DeepSpeed: imported only for a valid config
    from pipelines.train.console import closing_sentence
    from pipelines.train.driver import run_stage, shutdown_ray

    summary = run_stage(config)
    shutdown_ray()  # flushes whatever the workers still forward, so the summary is the last line
    print(closing_sentence(summary, resolve_tracking_uri(config.tracking.tracking_uri)), file=sys.stderr, flush=True)
    print(summary_json(summary), flush=True)
    return 1 if summary.get("error") else 0
