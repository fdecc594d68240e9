"""Stage 3, agent-improved training data: a teacher turns stage-2 commit rows into verified agentic trajectories.

    python jobs/stage3_data.py --corpus DIR --teacher EXPORT --out OUT [--max_rows N] [--attempts 4]
    ray job submit --working-dir . -- python jobs/stage3_data.py --corpus /mnt/c2 --teacher /mnt/export \\
        --use_gpu true --actors 8

DIR is a `jobs/build_corpus.py --stage 2` corpus; EXPORT a stage job's export/ (an in_context or rag model, or a GCA
pair). Writes OUT/train (accepted rows, the corpus schema plus teacher, attempt, verification), OUT/rejected (with
the reason) and OUT/manifest.json (counts by verification and by reason); train on it with
`jobs/stage2.py --data.train_path OUT/train`. `--dry-run` validates and prints the resolved config; a corpus that
is missing or not stage 2's stops the job before Ray starts (exit 2). Ends with a one-line JSON summary.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass

from pipelines.cli import parse_config
from pipelines.corpora.commits import CorpusError, commit_split
from pipelines.data.ray_session import data_job_ray
from pipelines.teachers.improve import Stage3Config, improve_corpus


@dataclass
class Stage3Job(Stage3Config):
    """Stage 3 and the local Ray it runs on."""

    num_cpus: int | None = None  # local Ray only: CPUs to use; None: $RAY_ADDRESS, a running cluster, or all CPUs


def summary(manifest: dict, out: str) -> dict:
    return {"accepted": manifest["accepted"], "rejected_by_reason": manifest["rejected_by_reason"],
            "accepted_by_verification": manifest["accepted_by_verification"], "rows_in": manifest["rows_in"],
            "seconds": manifest["seconds"], "out": out}


def main(argv: list[str] | None = None) -> dict:
    job = parse_config(argv, Stage3Job(), description=__doc__,
                       on_dry_run=lambda config: "# resolved config\n" + json.dumps(asdict(config), indent=1))
    config = Stage3Config(**{k: v for k, v in asdict(job).items() if k != "num_cpus"})
    try:
        # the corpus, checked before Ray starts: the user fixes it, not our code
        commit_split(config.corpus, config.split)
    except CorpusError as error:
        print(f"stage3_data: {error}", file=sys.stderr)
        print(json.dumps({"error": str(error).splitlines()[0], "out": config.out}), flush=True)
        sys.exit(2)
    with data_job_ray(job.num_cpus):
        manifest = improve_corpus(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    result = summary(manifest, config.out)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
