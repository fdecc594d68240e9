"""Build a corpus: stage 0 (code Q&A, document Q&A, needles) or stage 2 (commit reproduction), on Ray Data.

    python jobs/build_corpus.py --stage 0 --source PATH [--source PATH ...] --out DIR
    python jobs/build_corpus.py --stage 2 --source REPO --out DIR [--max-commits N]
    ray job submit --working-dir . -- python jobs/build_corpus.py --stage 0 --source /data/repo --out /mnt/corpus

Writes DIR/train, DIR/val, DIR/rejects (Parquet) and DIR/manifest.json; ends with a one-line JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys

from pipelines.data.corpora import BuildConfig, build_corpus
from pipelines.data.corpora.sources import Limits
from pipelines.data.corpora.tasks import Stage0Settings


def parse(argv: list[str] | None) -> tuple[BuildConfig, int | None]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", type=int, choices=(0, 2), required=True)
    p.add_argument("--source", action="append", required=True, help="directory, file or git repository (repeat)")
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", help="local Qwen3 checkpoint directory with tokenizer.json (default: offline)")
    p.add_argument("--per-subdir", action="store_true", help="each first-level directory is its own repository")
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--max-chunks", type=int, default=16, help="memory budget per row")
    p.add_argument("--val-fraction", type=float, default=0.1, help="share of repositories held out")
    p.add_argument("--max-file-bytes", type=int, default=1_000_000)
    p.add_argument("--text-field", default="text", help="JSONL field holding a document")
    p.add_argument("--max-commits", type=int, help="stage 2: newest commits per repository")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=int, help="local Ray only: CPUs to use (default: all)")
    a = p.parse_args(argv)
    settings = Stage0Settings(chunk_tokens=a.chunk_tokens, max_chunks=a.max_chunks, val_fraction=a.val_fraction,
                              seed=a.seed, limits=Limits(max_file_bytes=a.max_file_bytes, text_field=a.text_field))
    config = BuildConfig(stage=a.stage, sources=a.source, out=a.out, tokenizer=a.tokenizer,
                         per_subdir=a.per_subdir, stage0=settings, max_commits=a.max_commits)
    return config, a.num_cpus


def main(argv: list[str] | None = None) -> dict:
    import ray

    config, num_cpus = parse(argv)
    from pipelines.data.corpora.sources import check_sources

    try:
        check_sources(config.sources)  # a missing path fails here, before Ray starts
    except (FileNotFoundError, ValueError) as e:
        print(json.dumps({"error": str(e)}), flush=True)
        sys.exit(2)
    ray.init(num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True)
    try:
        manifest = build_corpus(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        ray.shutdown()
    summary = {"out": config.out, "stage": config.stage, "rows": manifest["rows"], "inputs": manifest["inputs"],
               "rejects": manifest["rejects"], "content_hash": manifest["content_hash"], "seconds": manifest["seconds"]}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
