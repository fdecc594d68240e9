"""Sharded reading: the row groups of a split dealt to ranks cover every row exactly once per epoch, a reader started
at any position continues exactly where an unbroken one would be, each rank reads about 1/world of the split, and
the manifest check refuses missing, truncated, rewritten and foreign shards and manifests without shard records."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines.format.shards import (MANIFEST, RankReader, ShardError, Split, check_split, head_rows, load_split,
                                      shard_record, split_units)

COLUMNS = ["input_ids", "labels", "memory_input_ids"]
VARIANTS = ["raw", "hinted", "imperative"]


def token_rows(n: int, seed: int = 0, width: int = 8) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        ids = rng.integers(5, 500, size=rng.integers(3, width)).tolist()
        rows.append({"variant": VARIANTS[i % 3], "input_ids": ids, "labels": ids,
                     "memory_input_ids": [rng.integers(5, 500, size=6).tolist()]})
    return rows


def write_manifest(out: Path, stage: int = 2) -> None:
    """The manifest jobs/build_corpus.py writes, for shards a test wrote itself: every split's Parquet files."""
    shards = {str(p.relative_to(out)): shard_record(p) for p in sorted(out.glob("*/*.parquet"))}
    (out / MANIFEST).write_text(json.dumps({"stage": stage, "sources": ["repo"], "shards": shards}))


def write_split(out: Path, rows: list[dict], *, files: int, row_group_rows: int, split: str = "train") -> Path:
    """`rows` over `files` shards of row groups of `row_group_rows`, and the manifest."""
    (out / split).mkdir(parents=True, exist_ok=True)
    for f in range(files):
        part = rows[f * len(rows) // files : (f + 1) * len(rows) // files]
        pq.write_table(pa.Table.from_pylist(part), out / split / f"part-{f:05d}.parquet", row_group_size=row_group_rows)
    write_manifest(out)
    return out / split


@pytest.fixture
def split(tmp_path) -> Path:
    return write_split(tmp_path, token_rows(103), files=3, row_group_rows=8)  # 15 row groups, uneven


def epoch_ids(reader: RankReader) -> list[int]:
    return [row["id"] for unit in reader.units for row in reader.read(unit)]


@pytest.mark.parametrize("world", [1, 2, 3, 16, 40])
def test_ranks_partition_the_split(split, world):
    """Every row exactly once per epoch across ranks, including 16 and 40 workers (more than the 15 row groups:
    dealt by row slices), and a row's id is its position in the split's fixed order."""
    shards = load_split(split)
    seen = [i for rank in range(world) for i in epoch_ids(RankReader(shards, rank, world, columns=COLUMNS))]
    assert sorted(seen) == list(range(103))
    table = pq.read_table(split, columns=["input_ids"]).to_pylist()  # files in name order, as the ids count
    reader = RankReader(shards, 1, 2, columns=COLUMNS)
    for row in reader.read(reader.units[0]):
        assert row["input_ids"] == table[row["id"]]["input_ids"]


def test_variant_filter_keeps_only_those_rows_once(split):
    shards = load_split(split)
    seen = [i for rank in range(3) for i in epoch_ids(RankReader(shards, rank, 3, columns=COLUMNS,
                                                                 variants=["hinted"]))]
    assert sorted(seen) == [i for i in range(103) if VARIANTS[i % 3] == "hinted"]


@pytest.mark.parametrize("variants", [None, ["raw", "imperative"]])
def test_resume_at_any_position_continues_exactly(split, variants):
    """A reader started at position p (a resumed run's step k: p = k * micro-batches * rows per micro-batch) yields
    what an unbroken reader yields from p on, across unit and epoch boundaries, on every rank."""
    shards = load_split(split)
    for rank in range(2):
        reader = RankReader(shards, rank, 2, columns=COLUMNS, variants=variants)
        unbroken = [r["id"] for r in islice(reader.rows(), 150)]
        for position in (1, 7, 8, 23, 49, 50, 51, 100):
            resumed = RankReader(shards, rank, 2, columns=COLUMNS, variants=variants)
            assert [r["id"] for r in islice(resumed.rows(position), 50)] == unbroken[position : position + 50]


def test_resume_skips_whole_units_unread(split):
    shards = load_split(split)
    reader = RankReader(shards, 0, 2, columns=COLUMNS)
    next(reader.rows(position=33))  # units of 8 rows: 4 skipped, the 5th read
    assert reader.read_rows == 8


def test_each_rank_reads_about_a_world_th(tmp_path):
    """Rows and bytes each rank reads in one epoch: 1/world of the split, within one row group."""
    split = write_split(tmp_path, token_rows(2000, width=60), files=4, row_group_rows=64)
    shards = load_split(split)
    total_bytes = sum(pq.ParquetFile(p).metadata.row_group(g).column(c).total_compressed_size
                      for p in shards.paths() for g in range(pq.ParquetFile(p).metadata.num_row_groups)
                      for c in range(1, 4))  # the token columns (column 0 is variant)
    for world in (2, 16):
        for rank in range(world):
            reader = RankReader(shards, rank, world, columns=COLUMNS)
            epoch_ids(reader)
            assert abs(reader.read_rows - 2000 / world) <= 64
            assert abs(reader.read_bytes - total_bytes / world) <= total_bytes * 64 / 2000
        print(f"world {world}: rank {rank} read {reader.read_rows} of 2000 rows, {reader.read_bytes} of "
              f"{total_bytes} bytes")


def test_validation_head_reads_only_its_row_groups(split):
    rows = head_rows(load_split(split), columns=COLUMNS, variants=None, limit=10)
    assert [r["id"] for r in rows] == list(range(10))
    asked = head_rows(load_split(split), columns=["variant", *COLUMNS], variants=["hinted"], limit=3)
    assert [(r["id"], r["variant"]) for r in asked] == [(1, "hinted"), (4, "hinted"), (7, "hinted")]  # asked: kept


def test_fewer_rows_than_workers_is_refused_with_the_fix(tmp_path):
    shards = load_split(write_split(tmp_path, token_rows(1), files=1, row_group_rows=8))
    assert len(split_units(shards, 2)) == 1
    with pytest.raises(ShardError, match=r"rank 1 of 2 \(the split holds 1 rows in 1 units\) has no training rows"):
        next(RankReader(shards, 1, 2, columns=COLUMNS).rows())


# ------------------------------------------------------------------------------------------- the manifest check
def test_check_accepts_the_built_split(split):
    checked = check_split(split)
    assert isinstance(checked, Split) and checked.rows == 103 and len(checked.paths()) == 3


def test_check_refuses_truncated_missing_and_foreign_shards(split):
    first, second, _ = sorted(split.glob("*.parquet"))
    first.write_bytes(first.read_bytes()[:200])
    second.unlink()
    pq.write_table(pa.Table.from_pylist(token_rows(2)), split / "stray.parquet")
    with pytest.raises(ShardError) as error:
        check_split(split)
    message = str(error.value)
    assert f"{first}: 200 bytes" in message and f"{second}: missing" in message
    assert f"{split / 'stray.parquet'}: not in" in message
    assert "rebuild the corpus: python jobs/build_corpus.py --stage 2 --sources repo --out" in message


def test_check_refuses_a_rewritten_shard_of_the_same_size_by_hash(split):
    first = sorted(split.glob("*.parquet"))[0]
    data = bytearray(first.read_bytes())
    data[100] ^= 0xFF
    first.write_bytes(bytes(data))
    check_split(split, hashes=False)  # size alone cannot see it
    with pytest.raises(ShardError, match="sha256 differs"):
        check_split(split)


def test_check_refuses_old_or_missing_manifests(split):
    manifest = json.loads((split.parent / MANIFEST).read_text())
    del manifest["shards"]
    (split.parent / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ShardError,
                       match="(?s)older jobs/build_corpus.py.*Rebuild the corpus: python jobs/build_corpus"):
        check_split(split)
    (split.parent / MANIFEST).unlink()
    with pytest.raises(ShardError, match="no manifest.json beside it"):
        check_split(split)
