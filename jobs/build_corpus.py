"""Build a corpus: stage 0 (code Q&A, document Q&A, needles) or stage 2 (commit reproduction), on Ray Data.

    python jobs/build_corpus.py --stage 0 --sources PATH [PATH ...] --out DIR
    python jobs/build_corpus.py --stage 2 --sources REPO --out DIR [--max_commits N]
    ray job submit --working-dir . -- python jobs/build_corpus.py --stage 0 --sources /data/repo --out /mnt/corpus

Writes DIR/train, DIR/val, DIR/rejects (Parquet) and DIR/manifest.json; ends with a one-line JSON summary.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass

from pipelines.cli import parse_config
from pipelines.corpora.build import BuildConfig, build_corpus
from pipelines.corpora.sources import check_sources
from pipelines.data.ray_session import data_job_ray


@dataclass
class BuildJob(BuildConfig):
    """The corpus build and the local Ray it runs on."""

    num_cpus: int | None = None  # local Ray only: CPUs to use; None: all

    def problems(self) -> list[str]:
        p = [] if self.stage in (0, 2) else [f"stage must be 0 or 2, got {self.stage}"]
        if self.row_group_rows <= 0:
            p.append(f"row_group_rows must be positive, got {self.row_group_rows}")
        try:
            check_sources(self.sources)  # a missing path fails here, before Ray starts
        except (FileNotFoundError, ValueError) as error:
            p.append(str(error))
        return p

    def build_config(self) -> BuildConfig:
        return BuildConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(BuildConfig)})


def main(argv: list[str] | None = None) -> dict:
    job = parse_config(argv, BuildJob(), description=__doc__)
    config = job.build_config()
    with data_job_ray(job.num_cpus):
        manifest = build_corpus(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    summary = {"out": config.out, "stage": config.stage, "rows": manifest["rows"], "inputs": manifest["inputs"],
               "rejects": manifest["rejects"], "content_hash": manifest["content_hash"], "seconds": manifest["seconds"]}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
