"""Stages fed by corpus shards: Parquet rows in jobs/build_corpus.py's schema, each worker reading only its own row
groups, get packed, train under ZeRO-3 on 2 workers, resume (after a clean stop or a worker failure) without repeating
or skipping an example, and report validation with and without the memory."""

from __future__ import annotations

import json
from itertools import cycle, islice
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipelines.cli import ConfigError
from pipelines.data.packing import PackingSpec, PackStats, collate_packed, pack_examples
from pipelines.format.shards import load_split, rank_units
from pipelines.train.configs.common import RunSettings, ScalingSettings, TrackingSettings, TrainConfig
from pipelines.train.configs.stage import DataConfig, ModelConfig, StageConfig
from tests.pipelines.format.test_shards import write_manifest
from tests.pipelines.train import faults

E = 8  # examples per step


def corpus_rows(n: int, seed: int) -> list[dict]:
    """Rows shaped like the corpus builder's: a prompt, a target that copies a span of the example's own memory."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        chunks = [rng.integers(5, 490, size=rng.integers(6, 16)).tolist() for _ in range(rng.integers(1, 4))]
        prompt = rng.integers(5, 500, size=rng.integers(3, 8)).tolist()
        target = chunks[0][:4] + [2]
        rows.append({
            "task": "commit", "variant": "hinted" if i % 2 else "raw", "prompt": f"p{i}", "target": f"t{i}",
            "input_ids": prompt + target, "labels": [-100] * len(prompt) + target, "memory_input_ids": chunks,
        })
    return rows


def write_shards(directory, rows: list[dict], shards: int = 2, row_group_rows: int = 6) -> None:
    """`rows` over `shards` files of row groups of `row_group_rows`, and the corpus manifest beside the split."""
    directory.mkdir(parents=True)
    for s in range(shards):
        part = rows[s * len(rows) // shards : (s + 1) * len(rows) // shards]
        pq.write_table(pa.Table.from_pylist(part), directory / f"part-{s:05d}.parquet", row_group_size=row_group_rows)
    write_manifest(directory.parent)


def expected_checksum(split, steps: int, world: int = 2) -> int:
    """The sum of the ids an unbroken run consumes: each rank cycles over its own row groups' rows, E / world per
    step."""
    total = 0
    for rank in range(world):
        ids = [i for u in rank_units(load_split(split), rank, world)
               for i in range(u.first_id, u.first_id + u.stop - u.start)]
        total += sum(islice(cycle(ids), steps * E // world))
    return total


def test_packing_keeps_every_token_and_chunk_of_every_example():
    rows = corpus_rows(12, seed=0)
    spec = PackingSpec(max_tokens=24, max_chunks=4, chunk_len=16)
    stats = PackStats()
    packed = pack_examples(rows, spec, stats)
    assert stats.examples == 12 and 1 < len(packed) < 12  # several examples share a row
    batch = collate_packed(packed, spec, stats)
    flat = [e for row in packed for e in row]
    assert [e["input_ids"] for e in flat] == [r["input_ids"] for r in rows]  # arrival order, nothing dropped
    for r, row in enumerate(packed):
        assert sum(len(e["input_ids"]) for e in row) <= spec.max_tokens
        for s, example in enumerate(row):
            tokens = batch["input_ids"][r][batch["segment_ids"][r] == s].tolist()
            assert tokens == list(example["input_ids"])
            assert batch["position_ids"][r][batch["segment_ids"][r] == s].tolist() == list(range(len(tokens)))
            chunks = batch["memory_input_ids"][r][batch["memory_segment_ids"][r] == s]
            masks = batch["memory_attention_mask"][r][batch["memory_segment_ids"][r] == s].bool()
            assert [c[m].tolist() for c, m in zip(chunks, masks)] == example["memory_input_ids"]
    assert (batch["labels"][batch["segment_ids"] < 0] == -100).all()
    assert stats.real_tokens == sum(len(r["input_ids"]) for r in rows)


def test_packing_reports_what_it_cuts():
    rows = corpus_rows(3, seed=1)
    rows[0]["input_ids"], rows[0]["labels"] = list(range(5, 45)), [-100] * 20 + list(range(25, 45))
    rows[1]["memory_input_ids"] = [[7] * 30] + [[8] * 4] * 6
    stats = PackStats()
    pack_examples(rows, PackingSpec(max_tokens=32, max_chunks=4, chunk_len=16), stats)
    assert (stats.truncated_tokens, stats.dropped_chunks, stats.cut_chunks) == (1, 3, 1)
    with pytest.raises(ValueError, match="labels"):
        pack_examples([{"input_ids": [1, 2], "labels": [1], "memory_input_ids": []}], PackingSpec())


def corpus_config(tmp_path, checkpoint_root, steps: int, name: str = "corpus", grad_accum: int = 1,
                  max_failures: int = 0) -> StageConfig:
    return StageConfig(
        stage=1,
        model=ModelConfig(pair="tiny", checkpoint_root=str(checkpoint_root), decoder="lora", encoder="frozen",
                          gca_layers="upper_half", lora_rank=4),
        data=DataConfig(train_path=str(tmp_path / "corpus" / "train"), val_path=str(tmp_path / "corpus" / "val"),
                        max_tokens=48, max_chunks=6, chunk_len=16, val_examples=16),
        train=TrainConfig(max_steps=steps, memories_per_step=E, grad_accum=grad_accum, lr=1e-3, warmup_steps=1,
                          log_every=2, eval_every=4, checkpoint_every=2),
        scaling=ScalingSettings(cpus_per_worker=0.5),
        run=RunSettings(name=name, storage_path=str(tmp_path / "ray"), max_failures=max_failures),
        tracking=TrackingSettings(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}"),
    )


@pytest.mark.ray
@pytest.mark.e2e
def test_corpus_stage_trains_resumes_and_validates(tmp_path, checkpoint_root, local_ray):
    from pipelines.train.recipes.jobs import train

    write_shards(tmp_path / "corpus" / "train", corpus_rows(40, seed=2))  # ranks: 4 row groups, 20 rows each
    write_shards(tmp_path / "corpus" / "val", corpus_rows(8, seed=3), shards=1)  # one batch: a rank has none
    first = train(corpus_config(tmp_path, checkpoint_root, steps=4))
    assert first["error"] is None and first["steps"] == 4
    resumed = train(corpus_config(tmp_path, checkpoint_root, steps=8))  # 32 rows a rank: a second epoch
    assert resumed["error"] is None and resumed["steps"] == 8
    state = json.loads((Path(resumed["checkpoint"]) / "trainer_state.json").read_text())
    assert state["index_checksum"] == expected_checksum(tmp_path / "corpus" / "train", 8)
    for key in ("val_loss", "no_memory_val_loss", "token_accuracy", "no_memory_token_accuracy"):
        assert resumed[key] is not None and np.isfinite(resumed[key]), key
    assert torch.tensor(resumed["val_loss"]) > 0
    changed = corpus_config(tmp_path, checkpoint_root, steps=8)  # the same run, trained differently: refused
    changed.train.lr = 5e-4
    with pytest.raises(ConfigError, match=r"train.lr 0.001 -> 0.0005\)"):
        train(changed)


@pytest.mark.ray
@pytest.mark.slow  # ~2 min; a worker failure and exact resume stay in `make test` (test_stage0.py, save:4)
def test_two_workers_on_their_own_shards_survive_a_failure_exactly(tmp_path, checkpoint_root, local_ray, fault_plan):
    """Two workers, each on its own row groups (uneven: 24 and 19 rows), 2 micro-batches a step; the last worker
    fails at step 5, after checkpoint 4: the run restarts from it and ends with the examples and index checksum of
    an unbroken run, i.e. no example repeated or skipped on either rank."""
    from pipelines.train.recipes.jobs import train

    split = tmp_path / "corpus" / "train"
    write_shards(split, corpus_rows(43, seed=4), shards=3, row_group_rows=5)
    write_shards(tmp_path / "corpus" / "val", corpus_rows(8, seed=3), shards=1)
    assert [sum(u.stop - u.start for u in rank_units(load_split(split), r, 2)) for r in (0, 1)] == [24, 19]
    marker = tmp_path / "ray" / "killed" / "injected-failure"
    faults.plan(fault_plan, "killed", "train:5", marker)
    summary = train(corpus_config(tmp_path, checkpoint_root, steps=8, name="killed", grad_accum=2, max_failures=1))
    assert summary["error"] is None and summary["steps"] == 8 and marker.is_file()  # it failed, and recovered
    state = json.loads((Path(summary["checkpoint"]) / "trainer_state.json").read_text())
    assert state["examples_seen"] == 8 * E and state["world"] == 2
    assert state["index_checksum"] == expected_checksum(split, 8)
