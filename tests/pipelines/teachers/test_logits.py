"""Teacher top-k logits: at each student target position the stored top-k is what the teacher gives when run by hand
on memory + row and sliced at the shifted position; the shards round-trip; the manifest states k*6 bytes per target
token and counts the rows over the teacher's budget; the Ray Data path writes the same shards."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pipelines.data.memory_modes import SYSTEM_FILE, MemoryMode
from pipelines.data.teacher_targets import dense_targets, read_scored, unit_items
from pipelines.format.rows import IGNORE
from pipelines.format.shards import check_split, split_units
from pipelines.teachers.logits import (TeacherLogitsConfig, TeacherScorer, bytes_per_target_token,
                                       compute_teacher_logits, score_rows, teacher_row, write_manifest)
from tests.pipelines.format.test_shards import write_split

K = 8
IN_CONTEXT = MemoryMode("in_context", context_budget=64)


def corpus_rows(n: int, seed: int = 0) -> list[dict]:
    """Rows in the corpus schema's token columns (tiny vocabulary): a prompt, a target, 1-3 memory chunks."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt, target = (rng.integers(1, 500, size=rng.integers(2, 7)).tolist() for _ in range(2))
        memory = [rng.integers(1, 500, size=rng.integers(3, 9)).tolist() for _ in range(rng.integers(1, 4))]
        rows.append({"variant": "raw", "input_ids": prompt + target, "labels": [IGNORE] * len(prompt) + target,
                     "memory_input_ids": memory})
    return rows


@pytest.fixture
def teacher(tmp_path, tiny):
    """An in_context export, as a stage job writes one (random weights)."""
    export = tiny.save_pretrained(tmp_path / "teacher")
    (export / SYSTEM_FILE).write_text(json.dumps({"memory": "in_context", "context_budget": 64, "rag_k": 2,
                                                  "needle": None}))
    return export


@pytest.fixture
def corpus(tmp_path):
    return write_split(tmp_path / "corpus", corpus_rows(11), files=2, row_group_rows=3)  # 4 row groups


def test_top_k_sits_at_the_students_targets_shifted_by_the_memory(tiny):
    """Batched, right-padded, logits kept at the targets only: the same top-k as the teacher run on each row alone,
    sliced by hand at t + memory - 1."""
    rows = corpus_rows(5, seed=1)
    scored = score_rows(tiny, rows, IN_CONTEXT, k=K, max_tokens=1024, batch_rows=3)
    for row, out in zip(rows, scored, strict=True):
        memory = [t for chunk in row["memory_input_ids"] for t in chunk]
        assert teacher_row(row, IN_CONTEXT) == (memory + row["input_ids"], len(memory))
        with torch.no_grad():
            logprobs = tiny(input_ids=torch.tensor([memory + row["input_ids"]])).logits[0].log_softmax(-1)  # (L, V)
        targets = [t for t, label in enumerate(row["labels"]) if label != IGNORE]
        assert out["positions"] == targets and not out["skipped"]
        values, ids = logprobs[[t + len(memory) - 1 for t in targets]].topk(K, dim=-1)  # (n, k)
        assert np.array_equal(out["topk_ids"].reshape(-1, K), ids.numpy())
        np.testing.assert_allclose(out["topk_logprobs"].reshape(-1, K), values.numpy(), atol=1e-2)


def test_dense_targets_align_with_the_labels(tiny):
    row = corpus_rows(1, seed=2)[0]
    (out,) = score_rows(tiny, [row], IN_CONTEXT, k=K, max_tokens=1024)
    ids, logprobs = dense_targets(out, len(row["labels"]), K)  # (T, k)
    has_entry = (ids[:, 0] >= 0).tolist()
    assert has_entry == [label != IGNORE for label in row["labels"]]
    assert torch.equal(ids[out["positions"]], torch.as_tensor(out["topk_ids"].reshape(-1, K), dtype=torch.long))


def run_in_process(config: TeacherLogitsConfig) -> dict:
    """The Ray path's actor and manifest, called here without Ray."""
    split = check_split(config.split)
    items = unit_items(config.out_dir().parent / "train", split_units(split, 1))
    scorer = TeacherScorer(config.teacher, config.k, config.max_tokens, config.batch_rows, str(config.out_dir()),
                           "float32", False)
    written = scorer({key: [item[key] for item in items] for key in items[0]})
    rows = [dict(zip(written, values)) for values in zip(*written.values())]
    return write_manifest(config.out_dir(), config, rows, split.root, "float32", 0.0)


def test_shards_round_trip_and_the_manifest_states_the_cost_and_the_skipped_rows(tmp_path, teacher, corpus, tiny):
    config = TeacherLogitsConfig(teacher=str(teacher), split=str(corpus), k=32, max_tokens=24, batch_rows=2)
    assert not config.problems()
    manifest = run_in_process(config)
    rows = corpus_rows(11)
    over = sum(len(teacher_row(row, IN_CONTEXT)[0]) > 24 for row in rows)
    assert 0 < over < len(rows)  # some rows over the teacher's budget, some within
    assert manifest["bytes_per_target_token"] == 32 * 6 == bytes_per_target_token(32)
    assert manifest["rows"] == 11 and manifest["skipped"] == {"too_long": over, "no_targets": 0}
    assert manifest["k"] == 32 and manifest["teacher"]["system"]["memory"] == "in_context"
    assert len(manifest["teacher"]["weights_sha256"]) == 64
    assert check_split(config.out_dir() / "train").rows == 11  # the shards match their manifest, beside the corpus
    stored = {}
    for name in manifest["shards"]:
        stored.update(read_scored(config.out_dir() / name, 32))
    assert sorted(stored) == list(range(11))  # every row, by its global id, skipped ones included
    expected = score_rows(tiny, rows, IN_CONTEXT, k=32, max_tokens=24)
    for i, want in enumerate(expected):
        got = stored[i]
        assert got["skipped"] == want["skipped"]
        assert got["topk_ids"].dtype == np.int32 and got["topk_logprobs"].dtype == np.float16
        assert np.array_equal(got["positions"], np.asarray(want["positions"], dtype=np.int32))
        assert np.array_equal(got["topk_ids"], np.asarray(want["topk_ids"]).reshape(-1, 32))
        assert np.array_equal(got["topk_logprobs"], np.asarray(want["topk_logprobs"]).reshape(-1, 32))
    assert manifest["target_tokens"] == sum(len(w["positions"]) for w in expected)


def test_a_teacher_without_its_memory_in_the_prompt_is_refused(tmp_path, teacher):
    (teacher / SYSTEM_FILE).write_text(json.dumps({"memory": "gca"}))
    problems = " ".join(TeacherLogitsConfig(teacher=str(teacher), split="", k=0).problems())
    assert "in its prompt" in problems and "split" in problems and "k must be positive" in problems


@pytest.mark.ray
def test_ray_data_writes_the_same_shards(tmp_path, teacher, corpus, ray_local):
    config = TeacherLogitsConfig(teacher=str(teacher), split=str(corpus), k=K, max_tokens=24, batch_rows=2)
    manifest = compute_teacher_logits(config)
    stored = {}
    for name in manifest["shards"]:
        stored.update(read_scored(config.out_dir() / name, K))
    local = TeacherLogitsConfig(**{**config.__dict__, "out": str(tmp_path / "local")})
    reference = run_in_process(local)
    assert manifest["rows"] == reference["rows"] == 11 and manifest["skipped"] == reference["skipped"]
    assert sorted(manifest["shards"]) == sorted(reference["shards"])
    for name in reference["shards"]:
        for row_id, row in read_scored(local.out_dir() / name, K).items():
            assert np.array_equal(stored[row_id]["topk_ids"], row["topk_ids"])
