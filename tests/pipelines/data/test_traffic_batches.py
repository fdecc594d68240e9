"""The traffic VLM's training batches (pipelines/data/traffic_batches.py) as the model reads them."""

from __future__ import annotations

import numpy as np

from pipelines.data.traffic_batches import collate, collate_scene_questions
from pipelines.data.traffic_scenes import QUESTION_TYPES, make_row, scene_seeds, split_of
from pipelines.data.traffic_tokenizer import build_traffic_tokenizer


def test_collate_reads_the_rows_as_the_model_does():
    seeds = scene_seeds("train", 6)
    assert all(split_of(s) == "train" for s in seeds) and seeds == sorted(seeds)
    assert not set(seeds) & set(scene_seeds("heldout", 50))
    rows = [make_row(s) for s in seeds]
    batch = collate({k: np.array([r[k] for r in rows], dtype=object) for k in ("png", "question", "answer")}, 64)
    assert batch["pixel_values"].shape == (6, 3, 64, 64)
    assert batch["labels"].tolist() == [0 if r["answer"] == "yes" else 1 for r in rows]  # 0 = [YES]
    lengths = batch["attention_mask"].sum(-1)
    assert all(batch["input_ids"][i, :n].tolist()[0] == 1 for i, n in enumerate(lengths.tolist()))  # [BOS] first
    assert (batch["input_ids"][batch["attention_mask"] == 0] == 0).all()  # right-padded with [PAD]


def test_collate_packed_asks_every_question_of_a_scene_in_a_shuffled_order():
    rows = [make_row(s) for s in scene_seeds("train", 4)]
    columns = {k: np.array([r[k] for r in rows], dtype=object) for k in ("png", "scene_questions", "scene_answers")}
    batch = collate_scene_questions(columns, 64, np.random.default_rng(0))
    assert batch["pixel_values"].shape == (4, 3, 64, 64) and "attention_mask" not in batch
    assert batch["answer_positions"].shape == batch["labels"].shape == (4, len(QUESTION_TYPES))
    tokenizer = build_traffic_tokenizer()
    orders = set()
    for b, row in enumerate(rows):
        ids, positions = batch["input_ids"][b].tolist(), batch["position_ids"][b].tolist()
        starts = [i for i, p in enumerate(positions) if p == 0]
        asked = []
        for q, end in enumerate(batch["answer_positions"][b].tolist()):
            start = max(s for s in starts if s <= end)
            assert ids[start] == tokenizer.token_to_id("[BOS]")
            assert positions[start:end + 1] == list(range(end - start + 1))
            text = tokenizer.decode(ids[start:end + 1])
            k = [tokenizer.decode(tokenizer.encode(t).ids) for t in row["scene_questions"]].index(text)
            asked.append(k)
            assert batch["labels"][b, q] == (0 if row["scene_answers"][k] == "yes" else 1)  # 0 = [YES]
        assert sorted(asked) == list(range(len(QUESTION_TYPES)))
        orders.add(tuple(asked))
        tail = max(batch["answer_positions"][b].tolist()) + 1
        assert set(ids[tail:]) <= {0} and positions[tail:] == list(range(len(ids) - tail))  # [PAD] tail
    assert len(orders) > 1  # shuffled row by row
