"""The corpus shards a training job reads: what the manifest records of each, the check a stage job runs on the driver
before any cluster time, and each training worker's own part of a split.

The manifest (OUT/manifest.json, jobs/build_corpus.py) records every shard file under `shards`, by its path relative
to OUT: bytes, rows, rows per Parquet row group and sha256. `check_split` compares a split directory against it:
a missing file, a size or hash that differs (a truncated or rewritten shard) or a Parquet file the manifest does not
list (a foreign shard) is refused, with its path and the command that rebuilds the corpus.

Sharding. The units are the row groups of a split, in a fixed order (shard paths sorted, row groups in file order),
dealt round-robin to the ranks: rank r of W reads units r, r+W, r+2W, ... and nothing else. A row's global id is its
position in that order (rows of the files before it + its row in the file), and the index checksum sums the ids of
the rows trained on. A rank reads its units in order, only the columns asked for (a variant filter applied as it
reads), and cycles through them: its own epoch. The stream is positional, so a resumed run starts at an exact row: it
skips whole units by their row counts from the manifest, reading nothing, then rows inside one unit. That needs the
same number of workers as the run it resumes (the dealing depends on W; the training loop refuses another).

Corner cases: a split with fewer row groups than workers is dealt by rows instead, each row group cut into
ceil(W / units) slices, so that every worker still has rows; a worker then reads whole row groups of which it keeps a
slice (build with a smaller --row_group_rows when that matters). Ranks' epochs differ by up to one unit in length, so
over many epochs a shorter rank's rows come round slightly more often than a longer rank's.
"""

from __future__ import annotations

import hashlib
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2  # 2: `shards` with bytes, rows, row_groups and sha256 per shard file
HASH_BLOCK = 8 << 20


class ShardError(ValueError):
    """Shards that do not match their manifest (or have none): one line per bad file, and the fix (rebuilding the
    corpus); nothing runs."""

    def __init__(self, problems: list[str], fix: str):
        super().__init__("\n".join(problems) + f"\n{fix}")
        self.problems, self.fix = problems, fix


# ------------------------------------------------------------------------------------------- the manifest side
def shard_record(path: str | Path) -> dict[str, Any]:
    """What the manifest keeps of one shard file (read from its footer and bytes)."""
    metadata = pq.ParquetFile(path).metadata
    return {"bytes": Path(path).stat().st_size, "rows": metadata.num_rows,
            "row_groups": [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)],
            "sha256": file_sha256(path)}


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):  # hashlib releases the GIL on large blocks: threads hash in parallel
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Split:
    """One split's shards as its manifest lists them: `root` is the manifest's directory, `shards` maps each file's
    path relative to it to its record. Small and picklable: it travels to the training workers."""

    root: str
    shards: dict[str, dict[str, Any]] = field(default_factory=dict)
    rebuild: str = ""  # the command that rebuilds this corpus, for error messages

    def paths(self) -> list[str]:
        return [str(Path(self.root) / name) for name in sorted(self.shards)]

    @property
    def rows(self) -> int:
        return sum(r["rows"] for r in self.shards.values())


def load_split(path: str | Path) -> Split:
    """The split directory `path` (e.g. OUT/train) as OUT/manifest.json lists it."""
    if "://" in str(path):
        raise ShardError([f"{path}: training reads shards from a filesystem path (a shared mount on a cluster), "
                          f"not a URI"], "copy the corpus to shared storage and pass its path")
    split = Path(path).resolve()
    manifest_file = split.parent / MANIFEST
    if not manifest_file.is_file():
        raise ShardError([f"{split}: no {MANIFEST} beside it ({manifest_file}), so its shards cannot be checked"],
                         f"build the corpus with `python jobs/build_corpus.py --stage N --sources SRC --out DIR` and "
                         f"pass DIR/{split.name}")
    manifest = json.loads(manifest_file.read_text())
    rebuild = rebuild_command(manifest, split.parent)
    if "shards" not in manifest:
        raise ShardError([f"{manifest_file} was written by an older jobs/build_corpus.py: it records no shard sizes, "
                          f"row groups or hashes to check the shards against"], f"Rebuild the corpus: {rebuild}")
    prefix = f"{split.name}/"
    shards = {name: record for name, record in manifest["shards"].items() if name.startswith(prefix)}
    return Split(str(split.parent), shards, rebuild)


def write_corpus(out: str | Path, splits: dict[str, list[dict[str, Any]]], *, row_group_rows: int = 256,
                 stage: int, sources: list[str], **facts: Any) -> Path:
    """Rows already in the corpus schema as OUT/<split>/part-00000.parquet and OUT/manifest.json (its `shards`
    recorded as jobs/build_corpus.py records them, plus `facts`), for corpora a job makes itself (stage 4's default)."""
    out = Path(out)
    for name, rows in splits.items():
        (out / name).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), out / name / "part-00000.parquet", row_group_size=row_group_rows)
    shards = {str(p.relative_to(out)): shard_record(p) for p in sorted(out.glob("*/*.parquet"))}
    manifest = {"version": MANIFEST_VERSION, "stage": stage, "sources": sources, **facts,
                "rows": {name: len(rows) for name, rows in splits.items()}, "shards": shards}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


def rebuild_command(manifest: dict[str, Any], out: Path) -> str:
    if manifest.get("rebuild"):  # a corpus another job wrote (stage 3) says how to rewrite it
        return manifest["rebuild"]
    sources = " ".join(manifest.get("sources") or ["SRC"])
    return f"python jobs/build_corpus.py --stage {manifest.get('stage', 'N')} --sources {sources} --out {out}"


def check_split(path: str | Path, *, hashes: bool = True, threads: int = 8) -> Split:
    """The split, after checking every shard on disk against the manifest: present, same size, same sha256 (with
    `hashes`; files hashed `threads` at a time), and no Parquet file the manifest does not list. Raises ShardError
    naming every bad file and the fix."""
    split = load_split(path)
    directory = Path(path).resolve()
    problems = [f"{directory / Path(name).name}: not in {Path(split.root) / MANIFEST} (a foreign shard)"
                for name in sorted(foreign_files(directory, split))]
    if not split.shards:
        problems.append(f"{directory}: {MANIFEST} lists no shards of this split")
    present = []
    for name, record in sorted(split.shards.items()):
        file = Path(split.root) / name
        if not file.is_file():
            problems.append(f"{file}: missing (the manifest lists it, {record['bytes']} bytes)")
        elif file.stat().st_size != record["bytes"]:
            problems.append(f"{file}: {file.stat().st_size} bytes, the manifest says {record['bytes']} (truncated "
                            f"or rewritten)")
        else:
            present.append((file, record))
    if hashes and present:
        with ThreadPoolExecutor(threads) as pool:
            digests = pool.map(file_sha256, [file for file, _ in present])
            problems += [f"{file}: sha256 differs from the manifest's (corrupted or rewritten)"
                         for (file, record), digest in zip(present, digests) if digest != record["sha256"]]
    if problems:
        raise ShardError(problems, f"rebuild the corpus: {split.rebuild}")
    return split


def check_splits(paths: list[str | None], *, hashes: bool) -> list[Split]:
    """check_split on each path given (train, val; the same path once), every problem of all of them in one error."""
    splits, problems, fixes = [], [], []
    for path in dict.fromkeys(p for p in paths if p):
        try:
            splits.append(check_split(path, hashes=hashes))
        except ShardError as error:
            problems += error.problems
            fixes += [error.fix] if error.fix not in fixes else []
    if problems:
        raise ShardError(problems, "\n".join(fixes))
    return splits


def foreign_files(directory: Path, split: Split) -> set[str]:
    listed = {str(Path(split.root) / name) for name in split.shards}
    return {str(p) for p in directory.rglob("*.parquet")} - listed


# ----------------------------------------------------------------------------------------- the worker side
@dataclass(frozen=True)
class Unit:
    """Rows [start, stop) of one row group; `first_id` is the global id of row `start`."""

    path: str
    row_group: int
    start: int
    stop: int
    first_id: int


def split_units(split: Split, world: int) -> list[Unit]:
    """Every row group of the split in the fixed order; cut into row slices when there are fewer than `world`."""
    units, offset = [], 0
    for path, name in zip(split.paths(), sorted(split.shards), strict=True):
        for group, rows in enumerate(split.shards[name]["row_groups"]):
            units.append(Unit(path, group, 0, rows, offset))
            offset += rows
    if 0 < len(units) < world:
        cuts = math.ceil(world / len(units))
        units = [Unit(u.path, u.row_group, u.start + a, u.start + b, u.first_id + a)
                 for u in units for a, b in _cuts(u.stop - u.start, cuts) if b > a]
    return units


def _cuts(rows: int, parts: int) -> list[tuple[int, int]]:
    return [(i * rows // parts, (i + 1) * rows // parts) for i in range(parts)]


def rank_units(split: Split, rank: int, world: int) -> list[Unit]:
    """Rank `rank`'s units: every `world`-th, from its own."""
    return split_units(split, world)[rank::world]


class RankReader:
    """One rank's rows (dicts of `columns` plus their global `id`), cycling over its units from any position, with
    what it has read so far (`read_rows`: rows decoded, whole row groups; `read_bytes`: their columns' compressed
    bytes)."""

    def __init__(self, split: Split, rank: int, world: int, *, columns: list[str], variants: list[str] | None = None):
        units = split_units(split, world)
        self.units, self.columns = units[rank::world], columns
        self.variants = set(variants) if variants else None
        self.read_rows = self.read_bytes = 0
        self._file: tuple[str, pq.ParquetFile] | None = None  # one open at a time: a rank's units come file by file
        self._where = f"rank {rank} of {world} (the split holds {split.rows} rows in {len(units)} units)"

    def rows(self, position: int = 0) -> Iterator[dict[str, Any]]:
        """The rows from `position` of this rank's cycle on, forever; whole units before it are skipped unread."""
        kept = [self._kept_rows(u) for u in self.units]  # rows per unit after the variant filter
        if not sum(kept):
            raise ShardError([f"{self._where} has no training rows{' of data.variants' if self.variants else ''}"],
                             "build a larger corpus, keep more variants, or use fewer workers")
        position %= sum(kept)
        index = 0
        while position >= kept[index]:
            position -= kept[index]
            index += 1
        while True:
            yield from self.read(self.units[index])[position:]
            position, index = 0, (index + 1) % len(self.units)

    def read(self, unit: Unit) -> list[dict[str, Any]]:
        """A unit's rows that pass the variant filter, in order, each with its id."""
        asked = "variant" in self.columns  # kept in the rows; otherwise read for the filter only
        columns = self.columns + (["variant"] if self.variants and not asked else [])
        table = self._read_group(unit, columns).slice(unit.start, unit.stop - unit.start)
        ids = unit.first_id + np.arange(table.num_rows)
        rows = table.to_pylist()
        if self.variants:
            variants = [row["variant"] if asked else row.pop("variant") for row in rows]
            keep = [i for i, variant in enumerate(variants) if variant in self.variants]
            rows, ids = [rows[i] for i in keep], ids[keep]
        for row, i in zip(rows, ids.tolist(), strict=True):
            row["id"] = i
        return rows

    def _kept_rows(self, unit: Unit) -> int:
        if not self.variants:
            return unit.stop - unit.start  # from the manifest: nothing read
        variants = self._read_group(unit, ["variant"]).column("variant").to_pylist()[unit.start : unit.stop]
        return sum(v in self.variants for v in variants)

    def _read_group(self, unit: Unit, columns: list[str]):
        if self._file is None or self._file[0] != unit.path:
            self._file = (unit.path, pq.ParquetFile(unit.path))
        f = self._file[1]
        group = f.metadata.row_group(unit.row_group)
        self.read_rows += group.num_rows
        self.read_bytes += sum(group.column(c).total_compressed_size for c in range(group.num_columns)
                               if group.column(c).path_in_schema.split(".")[0] in columns)
        return f.read_row_group(unit.row_group, columns=columns)


def head_rows(split: Split, *, columns: list[str], variants: list[str] | None, limit: int) -> list[dict[str, Any]]:
    """The split's first `limit` rows (after the variant filter) in the fixed order, reading only the row groups they
    are in: validation, which every rank reads whole."""
    reader, rows = RankReader(split, 0, 1, columns=columns, variants=variants), []
    for unit in reader.units:
        rows += reader.read(unit)[: limit - len(rows)]
        if len(rows) >= limit:
            break
    return rows
