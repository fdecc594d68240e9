"""What every training job's entry point does: command line -> typed config (or --dry-run) -> the corpus shards
checked against their manifest -> one run -> a one-line JSON summary as the last line of output. Parsing and the
shard check come first and import neither Ray Train nor DeepSpeed, so --help, --dry-run, a wrong flag and a bad shard
answer in seconds with nothing but their own lines (a bad shard: exit 2, no Ray, no MLflow run)."""

from __future__ import annotations

import sys
import time

from pipelines.cli import ConfigError, parse_config
from pipelines.data.shards import ShardError, check_splits
from pipelines.tracking.tracker import resolve_tracking_uri, summary_json
from pipelines.train.config import StageConfig, TrafficConfig, Ul2Config
from pipelines.train.plan import dry_run_report

JOB_NAMES = {Ul2Config: "encoder_ul2", TrafficConfig: "traffic_vlm"}  # a summary's "job", as the recipes name it


def run_job(argv: list[str] | None, default: StageConfig | Ul2Config | TrafficConfig, description: str) -> int:
    config = parse_config(argv, default, description=description, on_dry_run=dry_run_report)
    checked = {}
    if isinstance(config, StageConfig) and config.data.train_path:
        try:
            checked = check_shards(config)
        except ShardError as error:
            return refuse(config, str(error), {"error": "shards do not match the corpus manifest",
                                               "bad_shards": error.problems, "fix": error.fix})
    # Ray Train and DeepSpeed: imported only for a valid config
    from pipelines.train.console import closing_sentence
    from pipelines.train.driver import run_stage, shutdown_ray
    from pipelines.train.recipes.stage4 import run_stage4

    run = run_stage4 if isinstance(config, StageConfig) and config.stage == 4 else run_stage  # stage 4: 2-3 runs
    try:
        summary = run(config) | ({"shards_checked": checked} if checked else {})
    except ConfigError as error:  # found only on the driver (a resumed run's config): one line, exit 2, as at parsing
        return refuse(config, str(error), {"error": str(error)})
    shutdown_ray()  # flushes whatever the workers still forward, so the summary is the last line
    print(closing_sentence(summary, resolve_tracking_uri(config.tracking.tracking_uri)), file=sys.stderr, flush=True)
    print(summary_json(summary), flush=True)
    return 1 if summary.get("error") else 0


def check_shards(config: StageConfig) -> dict[str, float]:
    """Every shard the stage will read, against the corpus manifest: present, its size, no foreign file, and its
    sha256 with data.verify_hashes (about 1 CPU-second per GiB, 8 files at a time)."""
    d, started = config.data, time.perf_counter()
    splits = check_splits([d.train_path, d.val_path], hashes=d.verify_hashes)
    return {"shards": sum(len(s.shards) for s in splits), "hashed": d.verify_hashes,
            "seconds": round(time.perf_counter() - started, 2)}


def refuse(config: StageConfig | Ul2Config | TrafficConfig, message: str, summary: dict) -> int:
    """A bad shard or a config the driver refuses: the problem on stderr with its fix, and the summary line; exit
    status 2, as a config error."""
    job = f"stage{config.stage}" if isinstance(config, StageConfig) else JOB_NAMES[type(config)]
    for line in message.splitlines():
        print(f"{job}: {line}", file=sys.stderr)
    print(summary_json({"job": job, "steps": 0, **summary}), flush=True)
    return 2
