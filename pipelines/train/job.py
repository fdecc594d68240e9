"""What every training job's entry point does: command line -> typed config (or --dry-run) -> its job's pre-flight
checks (a stage's corpus shards against their manifest) -> its run -> a one-line JSON summary as the last line of
output. Parsing and the checks come first and import neither Ray Train nor DeepSpeed, so --help, --dry-run, a wrong
flag and a bad shard answer in seconds with nothing but their own lines (a bad shard: exit 2, no Ray, no MLflow run).
What differs per job is its Job (pipelines.train.recipes.jobs)."""

from __future__ import annotations

import sys

import yaml

from pipelines.cli import ConfigError, parse_config
from pipelines.format.shards import ShardError
from pipelines.tracking.tracker import resolve_tracking_uri, summary_json
from pipelines.train.configs.stage import StageConfig
from pipelines.train.configs.traffic import TrafficConfig
from pipelines.train.configs.ul2 import Ul2Config


def run_job(argv: list[str] | None, default: StageConfig | Ul2Config | TrafficConfig, description: str) -> int:
    config = parse_config(argv, default, description=description, on_dry_run=dry_run_report)
    from pipelines.train.recipes.jobs import job_for  # lazy: the model code, for a config that parsed

    job = job_for(config)
    try:
        checked = job.check(config)
    except ShardError as error:
        return refuse(job.name(config), str(error), {"error": "shards do not match the corpus manifest",
                                                     "bad_shards": error.problems, "fix": error.fix})
    # lazy: Ray Train and DeepSpeed (~5 s), imported only for a valid config; --help and --dry-run need neither
    from pipelines.train.console import closing_sentence
    from pipelines.train.driver import shutdown_ray

    try:
        summary = job.run(config) | ({"shards_checked": checked} if checked else {})
    except ConfigError as error:  # found only on the driver (a resumed run's config): one line, exit 2, as at parsing
        return refuse(job.name(config), str(error), {"error": str(error)})
    shutdown_ray()  # flushes whatever the workers still forward, so the summary is the last line
    print(closing_sentence(summary, resolve_tracking_uri(config.tracking.tracking_uri)), file=sys.stderr, flush=True)
    print(summary_json(summary), flush=True)
    return 1 if summary.get("error") else 0


def dry_run_report(config) -> str:
    """What a training job's --dry-run prints: its config with paths resolved as the driver will, then its job's own
    lines (a stage's memory plan, the traffic VLM's shape)."""
    from pipelines.train.recipes.jobs import job_for

    job = job_for(config)
    config = job.resolved(config)
    lines = ["# resolved config", yaml.safe_dump(config.to_dict(), sort_keys=False).rstrip()]
    return "\n".join(lines + job.dry_run(config))


def refuse(job: str, message: str, summary: dict) -> int:
    """A bad shard or a config the driver refuses: the problem on stderr with its fix, and the summary line; exit
    status 2, as a config error."""
    for line in message.splitlines():
        print(f"{job}: {line}", file=sys.stderr)
    print(summary_json({"job": job, "steps": 0, **summary}), flush=True)
    return 2
