"""The corpus build on Ray Data: list inputs on the driver (names only, grouped by repository), and for each
repository, on a worker: make records (read, parse, chunk, tokenize), build rows, write Parquet shards; the driver
aggregates one small statistics row per repository into the manifest.

    OUT/train/*.parquet, OUT/val/*.parquet   rows (schema: pipelines.format.rows.ROW_SCHEMA); split by repository
    OUT/rejects/*.parquet                    one row per rejected input: source, path, reason, detail
    OUT/manifest.json                        rows per task and split, token statistics, rejects by reason,
                                             inputs seen = used + rejected, facts that made no row by reason
                                             (`dropped_facts`, stage 0), sources, tokenizer, content hash, and
                                             every shard's bytes, rows, rows per row group and sha256 (`shards`)

Shards hold row groups of at most `row_group_rows` rows: the training job's unit of sharding
(pipelines.format.shards), so even a small corpus spreads over several workers.

Nothing of the corpus passes through the driver. Parallelism is across repositories: a corpus that is one big
repository builds on one worker (split it with `--per-subdir`).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa
import ray
import pyarrow.parquet as pq

from pipelines.corpora import commits, sources, tasks
from pipelines.format.rows import DICTIONARY_COLUMNS, ROW_SCHEMA
from pipelines.format.rows import make_row  # noqa: F401  (re-exported for custom row makers)
from pipelines.format.shards import MANIFEST_VERSION, shard_record
from pipelines.format.tokenizer import cached_tokenizer, describe

REJECT_SCHEMA = pa.schema([("source", pa.string()), ("path", pa.string()), ("reason", pa.string()),
                           ("detail", pa.string())])
ROWS_PER_SHARD = 2000
ROW_GROUP_ROWS = 256  # a few MB of token lists per row group: one read of a training worker


@dataclass
class BuildConfig:
    stage: int = 0  # 0: code/document Q&A + needles; 2: commit reproduction
    sources: list[str] = field(default_factory=list)  # directories, files or git repositories
    out: str = "outputs/corpus"  # the corpus directory: OUT/train, OUT/val and OUT/manifest.json
    # a local Qwen3 checkpoint directory (tokenizer.json); None: the offline one (Qwen ranks)
    tokenizer: str | None = None
    per_subdir: bool = False  # each first-level directory of a source is its own repository (e.g. site-packages)
    stage0: tasks.Stage0Settings = field(default_factory=tasks.Stage0Settings)
    max_commits: int | None = None  # stage 2: newest commits per repository
    workers: int | None = None  # repositories built at once; None: Ray Data decides (one per CPU)
    row_group_rows: int = ROW_GROUP_ROWS  # rows per Parquet row group, the unit training workers shard by


def write_unit(records: list[dict], *, out: str, make_rows: Callable, settings, checkpoint: str | None,
               row_group_rows: int = ROW_GROUP_ROWS) -> str:
    """All records of one repository -> rows -> Parquet shards, on a worker; returns its statistics (JSON), with
    each shard's record for the manifest (hashed here, in parallel, while the file is still in the page cache).
    make_rows returns (rows, extra input rejects) or (rows, extra input rejects, facts dropped by reason); the
    last two may fill while the rows are consumed, and are read after."""
    tokenizer = cached_tokenizer(checkpoint)
    unit = records[0]["unit"]
    split = tasks.split_of(unit, settings.val_fraction, settings.seed)
    rejects = [sources.reject(r["source"], r["path"], r["reject"], r.get("detail", "")) for r in records
               if r["reject"]]
    rows, extra_rejects, *dropped = make_rows(records, tokenizer, settings)  # rows: an iterable, written as it comes
    tag = hashlib.sha256(unit.encode()).hexdigest()[:10] + "-" + uuid.uuid4().hex[:6]
    digest, counts, variants = hashlib.sha256(), Counter(), Counter()
    input_tokens, memory_tokens, shard, pending, shards = [0, 0], [0, 0], 0, [], {}

    def flush():
        nonlocal shard, pending
        if pending:
            table = pa.Table.from_pylist(pending, schema=ROW_SCHEMA)
            name = f"{split}/part-{tag}-{shard:05d}.parquet"
            pq.write_table(table, os.path.join(out, name), use_dictionary=DICTIONARY_COLUMNS,
                           row_group_size=row_group_rows)
            shards[name] = shard_record(os.path.join(out, name))
            shard, pending = shard + 1, []

    for r in rows:
        for part in (r["prompt"], r["target"], *r["memory"]):  # length-prefixed, so parts cannot run together
            data = part.encode("utf-8", "surrogatepass")
            digest.update(len(data).to_bytes(8, "little") + data)
        counts[r["task"]] += 1
        variants[f'{r["task"]}/{r["variant"]}'] += 1
        input_tokens = [input_tokens[0] + len(r["input_ids"]), max(input_tokens[1], len(r["input_ids"]))]
        memory_tokens = [memory_tokens[0] + r["memory_tokens"], max(memory_tokens[1], r["memory_tokens"])]
        pending.append(r)
        if len(pending) >= ROWS_PER_SHARD:
            flush()
    flush()
    rejects += extra_rejects
    if rejects:
        pq.write_table(pa.Table.from_pylist(rejects, schema=REJECT_SCHEMA), os.path.join(out, "rejects",
                                                                                     f"part-{tag}.parquet"))
    stats = {
        "unit": unit, "source": records[0]["source"], "split": split, "inputs": len(records),
        "rejected_inputs": len(rejects),  # record rejects + rows-stage rejects (duplicates), all input-level
        "rejects": dict(Counter(r["reason"] for r in rejects)),
        "rows": dict(counts), "variants": dict(variants),
        "dropped_facts": {k: n for k, n in (dropped[0] if dropped else {}).items() if n},
        "input_tokens": input_tokens, "memory_tokens": memory_tokens,
        "source_tokens": sum(r.get("tokens", 0) for r in records),
        "source_bytes": sum(r.get("bytes", 0) for r in records),
        "hash": digest.hexdigest(), "shards": shards,
    }
    return json.dumps(stats)


def build_unit(names: list[dict], *, out: str, make_records: Callable, make_rows: Callable, settings,
               checkpoint: str | None, row_group_rows: int = ROW_GROUP_ROWS) -> str:
    """One repository, start to end (what a Ray task runs, callable without Ray): records -> rows -> Parquet."""
    tokenizer = cached_tokenizer(checkpoint)
    records = [rec for item in names for rec in make_records(item, tokenizer, settings)]
    return write_unit(records, out=out, make_rows=make_rows, settings=settings, checkpoint=checkpoint,
                      row_group_rows=row_group_rows)


def run_build(config: BuildConfig, *, items: list[dict], make_records: Callable, make_rows: Callable,
              settings, progress: Callable[[str], None] = print) -> dict:
    """The shared pipeline of both stages: items (names only) -> records -> per-repository rows and shards."""
    out = Path(config.out)
    for sub in ("train", "val", "rejects"):
        (out / sub).mkdir(parents=True, exist_ok=True)
        for old in (out / sub).glob("*.parquet"):
            old.unlink()  # a rebuild replaces, never mixes with, an older corpus
    started = time.time()
    checkpoint = config.tokenizer
    by_unit: dict[str, list[dict]] = defaultdict(list)
    for item in items:
        by_unit[item["unit"]].append(item)

    def unit_batch(batch: dict) -> pa.Table:
        """One task: a group of repositories."""
        return pa.table({"stats": [build_unit(names, out=str(out), make_records=make_records, make_rows=make_rows,
                                              settings=settings, checkpoint=checkpoint,
                                              row_group_rows=config.row_group_rows)
                                   for group in batch["units"] for names in json.loads(group)]})

    # Repositories are the unit of work and of the split (no shuffle: a hash shuffle reserves a CPU for its
    # operator and buffers every record, which on a small machine halves the record makers and holds the corpus
    # at once); small ones share a task, since each Ray Data task costs ~0.15-0.2 s of scheduling here.
    cpus = config.workers or (int(ray.cluster_resources().get("CPU", 1)) if ray.is_initialized() else os.cpu_count())
    groups = task_groups(list(by_unit.values()), cpus)
    ds = ray.data.from_items([{"units": json.dumps(group)} for group in groups], override_num_blocks=len(groups))
    ds = ds.map_batches(unit_batch, batch_size=1, batch_format="numpy", concurrency=config.workers)
    units = []
    for row in ds.iter_rows():  # one small statistics row per repository
        stats = json.loads(row["stats"])
        units.append(stats)
        progress(f"[corpus] {stats['unit']}: {sum(stats['rows'].values())} rows -> {stats['split']}, "
                 f"{stats['rejected_inputs']}/{stats['inputs']} inputs rejected ({time.time() - started:.0f}s)")
    manifest = make_manifest(config, units, time.time() - started)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def task_groups(units: list[list[dict]], cpus: int, tasks_per_cpu: int = 4) -> list[list[list[dict]]]:
    """Repositories (lists of items) grouped into about `tasks_per_cpu * cpus` tasks of similar weight (bytes where
    the listing knows them, else items), heaviest first, so the longest task does not start last and the tail is
    small tasks. A repository heavier than the target is a task of its own; one is never split."""
    def weight(names: list[dict]) -> int:
        return sum(i.get("bytes", 0) for i in names) or len(names)

    units = sorted(units, key=weight, reverse=True)
    target = sum(map(weight, units)) / max(1, tasks_per_cpu * cpus)
    groups, current, current_weight = [], [], 0
    for names in units:
        current.append(names)
        current_weight += weight(names)
        if current_weight >= target:
            groups.append(current)
            current, current_weight = [], 0
    return groups + [current] if current else groups


def make_manifest(config: BuildConfig, units: list[dict], seconds: float) -> dict:
    rows, rejects, variants, dropped = defaultdict(Counter), Counter(), Counter(), Counter()
    tokens = defaultdict(lambda: [0, 0, 0])  # split -> [rows, sum, max]
    for u in sorted(units, key=lambda u: u["unit"]):
        rows[u["split"]].update(u["rows"])
        rejects.update(u["rejects"])
        variants.update(u["variants"])
        dropped.update(u.get("dropped_facts", {}))
        t = tokens[u["split"]]
        t[0] += sum(u["rows"].values())
        t[1] += u["input_tokens"][0]
        t[2] = max(t[2], u["input_tokens"][1])
    inputs = sum(u["inputs"] for u in units)
    rejected = sum(u["rejected_inputs"] for u in units)
    return {
        "stage": config.stage, "sources": [str(s) for s in config.sources],
        "repositories": {s: sorted(u["unit"] for u in units if u["split"] == s) for s in ("train", "val")},
        "rows": {s: dict(c) for s, c in rows.items()}, "variants": dict(variants),
        "tokens": {s: {"rows": n, "input_tokens": total, "mean_input_tokens": total / max(n, 1), "max_input_tokens": m}
                   for s, (n, total, m) in tokens.items()},
        "memory_tokens": sum(u["memory_tokens"][0] for u in units),
        "source_tokens": sum(u["source_tokens"] for u in units), "source_bytes": sum(u["source_bytes"] for u in units),
        "inputs": {"seen": inputs, "used": inputs - rejected, "rejected": rejected},
        "rejects": dict(rejects),
        "dropped_facts": dict(dropped),
        "tokenizer": describe(cached_tokenizer(config.tokenizer)),
        "settings": asdict(config.stage0) if config.stage == 0 else {"max_commits": config.max_commits},
        "content_hash": hashlib.sha256("".join(sorted(u["hash"] for u in units)).encode()).hexdigest(),
        "seconds": round(seconds, 1),
        "manifest_version": MANIFEST_VERSION,
        "shards": dict(sorted((name, record) for u in units for name, record in u["shards"].items())),
    }


def stage0_items(config: BuildConfig) -> list[dict]:
    items = []
    for root in sources.check_sources(config.sources):
        name = root.name
        for rel in sources.walk_files(root):
            items.append({"root": str(root), "path": rel, "source": name, "bytes": sources.size_or_zero(root / rel),
                          "unit": tasks.unit_of(name, rel, config.per_subdir)})
    if not items:
        raise ValueError(f"no readable source files under {config.sources} (extensions: "
                         f"{sorted(set(sources.CODE_EXTENSIONS) | set(sources.DOC_EXTENSIONS))})")
    return items


def stage0_rows(records, tokenizer, settings):
    dropped = Counter()  # filled as the generator runs: rows are written as they are made
    return tasks.unit_rows(records, tokenizer, settings, dropped), [], dropped


def build_corpus(config: BuildConfig, progress: Callable[[str], None] = print) -> dict:
    """Entry point of both stages (jobs/build_corpus.py)."""
    if config.stage == 0:
        items = stage0_items(config)
        progress(f"[corpus] stage 0: {len(items)} files from {len(config.sources)} source(s)")
        return run_build(config, items=items, make_records=tasks.file_records, make_rows=stage0_rows,
                         settings=config.stage0, progress=progress)
    if config.stage == 2:
        items = commits.commit_items(config)
        progress(f"[corpus] stage 2: {len(items)} commits from {len(config.sources)} repository(ies)")
        settings = commits.CommitSettings(seed=config.stage0.seed, chunk_tokens=config.stage0.chunk_tokens,
                                          max_chunks=config.stage0.max_chunks,
                                          val_fraction=config.stage0.val_fraction)
        return run_build(config, items=items, make_records=commits.commit_records, make_rows=commits.unit_rows,
                         settings=settings, progress=progress)
    raise ValueError(f"--stage must be 0 or 2, got {config.stage}")
