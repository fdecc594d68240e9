"""Tokenize + chunk + pack throughput of the corpus pipeline on Ray Data, against plain single-process tiktoken
on the same files in the same run, and the driver's peak memory at two input sizes.

    python benchmarks/corpus_throughput.py [--mb 50] [--large-mb 150] [--num-cpus N]

Input: the installed packages' own source (site-packages, `.py`/`.md`/`.txt`, each package a repository), real
code nobody here wrote, taken package by package in name order until --mb megabytes. The pipeline is the build's
own (`pipelines.corpora.build.run_build`: listing on the driver; on workers, per repository: read, encode each
file once, cut <= 512-token chunks in token space, pack them 16 to a memory row, write Parquet) with the
memory-only record maker (`tasks.chunk_records`: chunks, no Q&A facts). Two cut modes: paragraph breaks (no parse)
and tree-sitter node boundaries (one parse per code file). Measured beside it, over the same files' text (NFC,
reading excluded, one process): `encode_ordinary` of a `tiktoken.Encoding` of the same ranks and regex (the
yardstick), and the pipeline's own encoder (fastokens); and the same per-repository work in this process without
Ray (`build.build_unit`), which shows what Ray's parallelism adds. Ray is warmed up untimed first (workers
started, tokenizer built in each).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import multiprocessing
import os
import site
import sys
import tempfile
import threading
import time
import unicodedata
from pathlib import Path

import psutil
import tiktoken

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipelines.corpora import build, sources, tasks  # noqa: E402
from pipelines.format.tokenizer import QWEN_PATTERN, cached_tokenizer, load_ranks  # noqa: E402

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


def one_process(packages: list[Path], syntax_cuts: bool) -> float:
    """The same per-repository work in one process, without Ray, after an untimed warm-up: seconds."""
    make_records = functools.partial(tasks.chunk_records, syntax_cuts=syntax_cuts)
    seconds = 0.0
    for timed in (False, True):
        with tempfile.TemporaryDirectory() as out:
            config = build.BuildConfig(stage=0, sources=[str(p) for p in packages[: None if timed else 2]], out=out)
            for sub in ("train", "val", "rejects"):
                os.makedirs(os.path.join(out, sub))
            by_unit: dict[str, list[dict]] = {}
            for item in build.stage0_items(config):
                by_unit.setdefault(item["unit"], []).append(item)
            start = time.perf_counter()
            for names in by_unit.values():
                build.build_unit(names, out=out, make_records=make_records, make_rows=pack_rows,
                                 settings=config.stage0, checkpoint=None)
            seconds = time.perf_counter() - start
    return seconds


def in_child(fn, *args):
    """Runs a baseline in a fresh process, so the driver's peak memory stays the pipeline's alone."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def encode_rates(packages: list[Path]) -> tuple[int, int, float, float]:
    """Bytes, tokens, and seconds to encode the same files' text in one process with tiktoken and with the
    pipeline's encoder (which must agree on every file)."""
    plain = tiktoken.Encoding("qwen3-plain", pat_str=QWEN_PATTERN, mergeable_ranks=load_ranks(), special_tokens={})
    tokenizer = cached_tokenizer(None)
    plain.encode_ordinary("warm up = 1\n")
    tokenizer.encode_array("warm up = 1\n")  # builds the encoder outside the timing
    nbytes = ntokens = 0
    tiktoken_seconds = encoder_seconds = 0.0
    for pkg in packages:
        for rel in sources.walk_files(pkg):
            text, reason = sources.read_text(str(pkg / rel), sources.Limits())
            if reason or sources.kind_of(rel) == "jsonl":
                continue
            text = unicodedata.normalize("NFC", text)
            start = time.perf_counter()
            ids = plain.encode_ordinary(text)
            tiktoken_seconds += time.perf_counter() - start
            start = time.perf_counter()
            fast = tokenizer.encode_array(text)
            encoder_seconds += time.perf_counter() - start
            if fast.tolist() != ids:
                raise AssertionError(f"the pipeline's encoder and tiktoken disagree on {pkg / rel}")
            ntokens += len(ids)
            nbytes += len(text.encode())
    return nbytes, ntokens, tiktoken_seconds, encoder_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=50.0)
    parser.add_argument("--large-mb", type=float, default=150.0, help="a larger paragraph-cut run (0: skip)")
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count())
    args = parser.parse_args()
    import ray

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    from ray.data import DataContext

    DataContext.get_current().enable_progress_bars = False
    cached_tokenizer(None).backend()  # the driver's copy loads before any measurement
    with tempfile.TemporaryDirectory() as out:  # untimed warm-up: every Ray worker starts and builds its tokenizer
        run_pipeline(pick_packages(4 * args.num_cpus), out, syntax_cuts=True)
    runs = [(args.mb / 4, False), (args.mb, False), (args.mb, True)]
    runs += [(args.large_mb, False)] if args.large_mb else []
    results = []
    for megabytes, syntax_cuts in runs:
        packages = pick_packages(megabytes)
        with tempfile.TemporaryDirectory() as out:
            manifest, seconds, peak = run_pipeline(packages, out, syntax_cuts)
            written = sum(f.stat().st_size for f in Path(out).rglob("*.parquet"))
        alone = in_child(one_process, packages, syntax_cuts)
        nbytes, ntokens, tiktoken_seconds, encoder_seconds = in_child(encode_rates, packages)
        results.append((syntax_cuts, len(packages), manifest, seconds, alone, peak, nbytes, ntokens,
                        tiktoken_seconds, encoder_seconds, written))
        print(f"[bench] {megabytes:.1f} MB target, {'syntax' if syntax_cuts else 'paragraph'} cuts: "
              f"{len(packages)} packages, {manifest['source_bytes'] / 1e6:.1f} MB in {seconds:.1f}s (Ray), "
              f"{alone:.1f}s (one process)", file=sys.stderr, flush=True)
    ray.shutdown()
    print(f"\n{args.num_cpus} CPUs; MB/s of source bytes; ratio = pipeline (Ray) / tiktoken in one process; "
          "the goal is 0.8 x cores\n")
    print("| input | cuts | packages | pipeline MB/s (Ray) | same, 1 process | Ray speed-up | tiktoken 1-proc MB/s "
          "| ratio | goal | fastokens 1-proc MB/s | pipeline tok/s | driver peak RSS | Parquet written |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (syntax_cuts, n, manifest, seconds, alone, peak, nbytes, ntokens, tiktoken_seconds, encoder_seconds,
         written) in results:
        source_mb = manifest["source_bytes"] / 1e6
        pipe_mbs, tiktoken_mbs = source_mb / seconds, nbytes / 1e6 / tiktoken_seconds
        print(f"| {source_mb:.1f} MB | {'tree-sitter' if syntax_cuts else 'paragraph'} | {n} | {pipe_mbs:.2f} "
              f"| {source_mb / alone:.2f} | {alone / seconds:.2f}x | {tiktoken_mbs:.2f} "
              f"| {pipe_mbs / tiktoken_mbs:.2f} "
              f"| {0.8 * args.num_cpus:.1f} | {nbytes / 1e6 / encoder_seconds:.1f} "
              f"| {manifest['source_tokens'] / seconds:,.0f} | {peak / 2**20:,.0f} MiB | {written / 1e6:,.0f} MB |")


if __name__ == "__main__":
    main()
