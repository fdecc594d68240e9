"""The teacher's top-k targets as stage 4 stores them (pipelines.teachers.logits computes them) and as a training worker
reads them: one Parquet shard per corpus row group, joined to the packed rows by global row id, laid out as the
labels are (see pipelines.teachers.logits for the format and its storage cost)."""

from __future__ import annotations

import bisect
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pipelines.format.shards import Split, Unit, split_units

SCHEMA = pa.schema([("id", pa.int64()), ("skipped", pa.string()), ("positions", pa.list_(pa.int32())),
                    ("topk_ids", pa.list_(pa.int32())), ("topk_logprobs", pa.list_(pa.float16()))])


def write_scored(path: Path, scored: list[dict[str, Any]]) -> None:
    def flat(key: str, dtype, arrow_type) -> pa.Array:
        values = [np.asarray(r[key], dtype=dtype) for r in scored]
        offsets = np.cumsum([0] + [len(v) for v in values]).astype(np.int32)
        flat_values = np.concatenate(values) if values else np.zeros(0, dtype)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat_values, type=arrow_type))

    table = pa.Table.from_arrays(
        [pa.array([r["id"] for r in scored], pa.int64()), pa.array([r["skipped"] for r in scored], pa.string()),
         flat("positions", np.int32, pa.int32()), flat("topk_ids", np.int32, pa.int32()),
         flat("topk_logprobs", np.float16, pa.float16())], schema=SCHEMA)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)


def read_scored(path: str | Path, k: int) -> dict[int, dict[str, Any]]:
    """A teacher shard's rows by id: positions (n,) int32, topk_ids (n, k) int32, topk_logprobs (n, k) float16."""
    table = pq.read_table(path)
    rows = {}
    for i, row_id in enumerate(table.column("id").to_pylist()):
        positions = np.asarray(table.column("positions")[i].values, dtype=np.int32)
        rows[row_id] = {"skipped": table.column("skipped")[i].as_py(), "positions": positions,
                        "topk_ids": np.asarray(table.column("topk_ids")[i].values).reshape(len(positions), k),
                        "topk_logprobs": np.asarray(table.column("topk_logprobs")[i].values).reshape(len(positions), k)}
    return rows


def dense_targets(entry: dict[str, Any], length: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stored row as the loss takes it, aligned to the student's labels: ids (length, k) int64 with -1 where the
    teacher has no entry, log-probs (length, k) float32 (0 there). Positions at or past `length` (a row packing cut
    to data.max_tokens) are dropped with the tokens they belonged to."""
    ids = torch.full((length, k), -1, dtype=torch.long)
    logprobs = torch.zeros((length, k), dtype=torch.float32)
    positions = np.asarray(entry["positions"], dtype=np.int64)
    kept = positions < length
    if kept.any():
        at = torch.as_tensor(positions[kept])
        ids[at] = torch.as_tensor(np.asarray(entry["topk_ids"], dtype=np.int64).reshape(-1, k)[kept])
        logprobs[at] = torch.as_tensor(np.asarray(entry["topk_logprobs"], dtype=np.float32).reshape(-1, k)[kept])
    return ids, logprobs


class TeacherEntries:
    """A split's stored teacher entries by global row id (the corpus split's fixed order, pipelines.format.shards),
    read one teacher shard at a time: a rank reads its row groups in order, so it opens only its own."""

    def __init__(self, directory: str | Path, split: Split, k: int):
        units = split_units(split, 1)  # whole row groups, as compute_teacher_logits wrote them
        self.directory, self.k = Path(directory), k
        self.names = [item["name"] for item in unit_items(Path(split.paths()[0]).parent, units)]
        self.starts = [u.first_id for u in units]
        self._shard: tuple[str, dict[int, dict[str, Any]]] | None = None

    def get(self, row_id: int) -> dict[str, Any] | None:
        """The row's entry (None for an id the teacher never scored: then the row counts in the CE only)."""
        index = bisect.bisect_right(self.starts, row_id) - 1
        if index < 0:
            return None
        name = self.names[index]
        if self._shard is None or self._shard[0] != name:
            path = self.directory / name
            self._shard = (name, read_scored(path, self.k) if path.is_file() else {})
        return self._shard[1].get(row_id)


def teacher_tensors(packed: list[list[dict]], entries: TeacherEntries, width: int) -> dict[str, torch.Tensor]:
    """The teacher's targets for packed rows (pipelines.data.packing, examples carrying their `id`), laid out as
    collate_packed lays out their labels: teacher_ids (B, width, k) int64 (-1: no entry, e.g. a skipped row or a
    prompt position), teacher_logprobs (B, width, k) float32."""
    k = entries.k
    ids = torch.full((max(len(packed), 1), width, k), -1, dtype=torch.long)
    logprobs = torch.zeros((max(len(packed), 1), width, k), dtype=torch.float32)
    for r, row in enumerate(packed):
        offset = 0
        for example in row:
            n = len(example["input_ids"])
            entry = entries.get(example["id"]) if "id" in example else None
            if entry is not None and not entry["skipped"]:
                ids[r, offset : offset + n], logprobs[r, offset : offset + n] = dense_targets(entry, n, k)
            offset += n
    return {"teacher_ids": ids, "teacher_logprobs": logprobs}


def unit_items(split_dir: Path, units: list[Unit]) -> list[dict[str, Any]]:
    """Each row group of the split as a work item, with the name of the teacher shard it becomes."""
    return [{**asdict(u), "name": f"{split_dir.name}/{Path(u.path).stem}-{u.row_group:05d}.parquet"} for u in units]
