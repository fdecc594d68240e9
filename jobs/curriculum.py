"""The curriculum, stages 0 -> 1 -> 2 -> 3 -> 4, each starting from the previous stage's export, on the tiny pair.

    python jobs/curriculum.py                                  # this repository's files and history, tiny pair, CPU
    python jobs/curriculum.py --sources ~/src/some-repo --out outputs/curriculum --steps 200
    python jobs/curriculum.py --dry-run                        # the chain of job commands it would run

Builds the stage-0 and stage-2 corpora, trains stage 0 (code Q&A), 1 and 2 (commits), an in_context teacher,
improves stage-2 data with it (stage 3) and distills it into the stage-2 student (stage 4). Each stage's MLflow run
and registered model version is tagged with the one before it; a rerun with the same --out continues after the last
finished step. Ends with a one-line JSON summary.
"""

from __future__ import annotations

import sys

from pipelines.cli import parse_config
from pipelines.curriculum import CurriculumConfig, plan, run_curriculum
from pipelines.tracking.tracker import summary_json


def main(argv: list[str] | None = None) -> int:
    config = parse_config(argv, CurriculumConfig(), description=__doc__, on_dry_run=plan)
    summary = run_curriculum(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(summary_json(summary), flush=True)
    return 1 if summary.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
