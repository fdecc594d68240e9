"""Register a training run's exported artifact in the MLflow model registry, or promote a version.

    python jobs/register.py --run_id RUN_ID [--name awareness] [--alias candidate]
    python jobs/register.py --run_id RUN_ID --step 200   # the checkpoint of step 200 (the run's checkpoint.200 tag)
    python jobs/register.py --promote VERSION [--name awareness]       # moves the alias `production`

Uses $MLFLOW_TRACKING_URI (or --tracking_uri), else ./mlflow.db. Prints a one-line JSON summary.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from pipelines.cli import parse_config
from pipelines.tracking.registry import DEFAULT_NAME
from pipelines.tracking.tracker import summary_json


@dataclass
class RegisterArgs:
    run_id: str | None = None  # an MLflow run with an export/ artifact (a stage job's run, a sweep trial)
    promote: str | None = None  # a model version: point the alias `production` at it
    name: str = DEFAULT_NAME  # registered model name
    alias: str | None = None  # None: candidate (register), production (promote)
    tracking_uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else ./mlflow.db
    step: int | None = None  # the run's checkpoint of this step (its export/ on the storage path); None: final export

    def problems(self) -> list[str]:
        if (self.run_id is None) == (self.promote is None):
            return ["give exactly one of --run_id RUN_ID (register) and --promote VERSION"]
        if self.step is not None and self.run_id is None:
            return ["--step picks a checkpoint of --run_id RUN_ID"]
        return []


def main(argv: list[str] | None = None) -> dict:
    args = parse_config(argv, RegisterArgs(), description=__doc__)
    # lazy: MLflow and the model code, for arguments that parsed (a wrong flag answers in a second)
    from mlflow.exceptions import MlflowException

    from pipelines.serving.register import register_run
    from pipelines.tracking.registry import describe, promote

    try:
        if args.run_id:
            version = register_run(args.run_id, tracking_uri=args.tracking_uri, name=args.name,
                                   alias=args.alias or "candidate", step=args.step)
        else:
            version = promote(args.promote, tracking_uri=args.tracking_uri, name=args.name,
                              alias=args.alias or "production")
    except (FileNotFoundError, MlflowException) as error:  # an unknown run or version: the user's to fix
        print(f"register.py: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    summary = {"job": "register", **describe(version),
               "alias": args.alias or ("candidate" if args.run_id else "production")}
    print(summary_json(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
