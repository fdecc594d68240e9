"""Register a training run's exported artifact in the MLflow model registry, or promote a version.

    python jobs/register.py --run-id RUN_ID [--name awareness] [--alias candidate]
    python jobs/register.py --promote VERSION [--name awareness]       # moves the alias `production`

Uses $MLFLOW_TRACKING_URI (or --tracking-uri), else ./mlflow.db. Prints a one-line JSON summary.
"""

from __future__ import annotations

import argparse

from pipelines.tracking.registry import DEFAULT_NAME, describe, promote, register_run
from pipelines.tracking.tracker import summary_json


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--run-id", help="an MLflow run with an export/ artifact (a stage job's run, a sweep trial)")
    action.add_argument("--promote", metavar="VERSION", help="point the alias `production` at this version")
    parser.add_argument("--name", default=DEFAULT_NAME, help="registered model name")
    parser.add_argument("--alias", default=None, help="default: candidate (register), production (promote)")
    parser.add_argument("--tracking-uri", default=None)
    args = parser.parse_args(argv)
    try:
        if args.run_id:
            version = register_run(args.run_id, tracking_uri=args.tracking_uri, name=args.name,
                                   alias=args.alias or "candidate")
        else:
            version = promote(args.promote, tracking_uri=args.tracking_uri, name=args.name,
                              alias=args.alias or "production")
    except FileNotFoundError as error:
        raise SystemExit(f"register: {error}") from error
    summary = {"job": "register", **describe(version), "alias": args.alias or ("candidate" if args.run_id else "production")}
    print(summary_json(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
