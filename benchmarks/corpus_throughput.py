"""Tokenize + chunk + pack throughput of the corpus pipeline on Ray Data, against plain single-process tiktoken
on the same files in the same run, and the driver's peak memory at two input sizes.

    python benchmarks/corpus_throughput.py [--mb 50] [--num-cpus N]

Input: the installed packages' own source (site-packages, `.py`/`.md`/`.txt`, each package a repository), real
code nobody here wrote, taken package by package in name order until --mb megabytes. The pipeline is the build's
own (`pipelines.corpora.build.run_build`: listing on the driver; on workers, per repository: read, encode each
file once, cut ~512-token chunks in token space, pack them 16 to a memory row, write Parquet) with the memory-only
record maker (`tasks.chunk_records`: chunks, no Q&A facts). Two cut modes: paragraph breaks (no parse) and
tree-sitter node boundaries (one parse per code file, which costs about as much as tokenizing it). The baseline
is `encode_ordinary` (after NFC, as the pipeline) over the same files' text in one process, reading excluded.
"""

from __future__ import annotations

import argparse
import functools
import os
import site
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.corpora import build, sources, tasks  # noqa: E402
from pipelines.corpora.tokenizer import cached_tokenizer  # noqa: E402

SKIP = {"torch", "ray", "pip", "setuptools", "__pycache__"}  # one-package giants would be a single repository
PACK = 16


def pick_packages(megabytes: float) -> list[Path]:
    root = Path(site.getsitepackages()[0])
    chosen, total = [], 0
    for pkg in sorted(p for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name not in SKIP):
        size = sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file() and not f.is_symlink()
                   and sources.kind_of(f.name) and f.stat().st_size <= 1_000_000 and "__pycache__" not in f.parts)
        chosen.append(pkg)
        total += size
        if total >= megabytes * 1e6:
            break
    return chosen


def pack_rows(records, tokenizer, settings):
    """Every chunk of the repository once, packed into memory rows of PACK chunks (no questions)."""
    pool = tasks.unit_chunks([r for r in records if not r["reject"]])
    unit, source = records[0]["unit"], records[0]["source"]
    rows = []
    for i in range(0, len(pool), PACK):
        memory = pool[i : i + PACK]
        rows.append(build.make_row(task="pack", variant="", kind="", prompt=[""], target=[""], answer="",
                                   memory=[c.text for c in memory], memory_ids=[c.ids for c in memory],
                                   source=source, unit=unit, evidence=(memory[0].path, 1, 1), tokenizer=tokenizer))
    return rows, []


class PeakRSS:
    """Samples the driver's resident memory every 50 ms."""

    def __enter__(self):
        self.peak, self.done = 0, False
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        proc = psutil.Process()
        while not self.done:
            self.peak = max(self.peak, proc.memory_info().rss)
            time.sleep(0.05)

    def __exit__(self, *exc):
        self.done = True
        self.thread.join()


def run_pipeline(packages: list[Path], out: str, syntax_cuts: bool) -> tuple[dict, float, int]:
    config = build.BuildConfig(stage=0, sources=[str(p) for p in packages], out=out)
    items = build.stage0_items(config)
    make_records = functools.partial(tasks.chunk_records, syntax_cuts=syntax_cuts)
    with PeakRSS() as rss:
        start = time.perf_counter()
        manifest = build.run_build(config, items=items, make_records=make_records, make_rows=pack_rows,
                                   settings=config.stage0, progress=lambda line: None)
        seconds = time.perf_counter() - start
    return manifest, seconds, rss.peak


def baseline(packages: list[Path]) -> tuple[int, int, float]:
    """Single-process tiktoken: bytes, tokens, encode seconds over the same files the pipeline used."""
    tokenizer = cached_tokenizer(None)
    nbytes = ntokens = 0
    seconds = 0.0
    for pkg in packages:
        for rel in sources.walk_files(pkg):
            text, reason = sources.read_text(str(pkg / rel), sources.Limits())
            if reason or sources.kind_of(rel) == "jsonl":
                continue
            start = time.perf_counter()
            ntokens += len(tokenizer.encode_text(text))
            seconds += time.perf_counter() - start
            nbytes += len(text.encode())
    return nbytes, ntokens, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count())
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    cached_tokenizer(None).backend()  # the driver's copy loads before any measurement
    with tempfile.TemporaryDirectory() as out:  # untimed warm-up: Ray workers start, import, build their tokenizer
        run_pipeline(pick_packages(0.5)[:args.num_cpus], out, syntax_cuts=True)
    results = []
    for megabytes, syntax_cuts in ((args.mb / 4, False), (args.mb, False), (args.mb, True)):
        packages = pick_packages(megabytes)
        with tempfile.TemporaryDirectory() as out:
            manifest, seconds, peak = run_pipeline(packages, out, syntax_cuts)
            written = sum(f.stat().st_size for f in Path(out).rglob("*.parquet"))
        nbytes, ntokens, base_seconds = baseline(packages)
        results.append((megabytes, syntax_cuts, len(packages), manifest, seconds, peak, nbytes, ntokens,
                        base_seconds, written))
        print(f"[bench] {megabytes:.1f} MB target, {'syntax' if syntax_cuts else 'paragraph'} cuts: "
              f"{len(packages)} packages, {manifest['source_bytes'] / 1e6:.1f} MB read in {seconds:.1f}s",
              file=sys.stderr, flush=True)
    ray.shutdown()
    print(f"\n{args.num_cpus} CPUs; tokens = source tokens (chunk headers included for the pipeline)\n")
    print("| input | cuts | packages | pipeline MB/s | pipeline tok/s | tiktoken 1-proc MB/s | tiktoken tok/s | ratio "
          "| goal (0.8 x cores) | driver peak RSS | Parquet written |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for megabytes, syntax_cuts, n, manifest, seconds, peak, nbytes, ntokens, base_seconds, written in results:
        pipe_mbs, base_mbs = manifest["source_bytes"] / 1e6 / seconds, nbytes / 1e6 / base_seconds
        print(f"| {manifest['source_bytes'] / 1e6:.1f} MB | {'tree-sitter' if syntax_cuts else 'paragraph'} | {n} "
              f"| {pipe_mbs:.2f} | {manifest['source_tokens'] / seconds:,.0f} | {base_mbs:.2f} "
              f"| {ntokens / base_seconds:,.0f} | {pipe_mbs / base_mbs:.2f} | {0.8 * args.num_cpus:.1f} "
              f"| {peak / 2**20:,.0f} MiB | {written / 1e6:,.0f} MB |")

if __name__ == "__main__":
    main()
