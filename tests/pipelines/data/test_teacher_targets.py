"""Stage 4's stored teacher targets (pipelines/data/teacher_targets.py) against hand-written rows: the shard format
round-trips, a row's targets land at its label positions, and packed rows get each example's targets at its offset.
(The whole path, from a teacher's logits to a training worker's batch: tests/pipelines/teachers/test_logits.py and
tests/pipelines/train/recipes/test_stage4.py.)"""

from __future__ import annotations

import numpy as np
import torch

from pipelines.data.teacher_targets import dense_targets, read_scored, teacher_tensors, write_scored

K = 2
# as pipelines.teachers.logits stores them: top-k lists flat, row-major (position, rank)
SCORED = [
    {"id": 7, "skipped": "", "positions": [1, 3], "topk_ids": [5, 6, 7, 8],
     "topk_logprobs": [-0.5, -1.25, -0.25, -2.0]},  # exact in float16
    {"id": 9, "skipped": "too long", "positions": [], "topk_ids": [], "topk_logprobs": []},
]


def test_a_shard_round_trips(tmp_path):
    path = tmp_path / "val" / "part-00000.parquet"
    write_scored(path, SCORED)
    rows = read_scored(path, K)
    assert sorted(rows) == [7, 9]
    assert rows[7]["skipped"] == "" and rows[9]["skipped"] == "too long"
    assert rows[7]["positions"].tolist() == [1, 3]
    assert rows[7]["topk_ids"].tolist() == [[5, 6], [7, 8]]
    assert rows[7]["topk_logprobs"].dtype == np.float16
    assert rows[7]["topk_logprobs"].tolist() == [[-0.5, -1.25], [-0.25, -2.0]]
    assert rows[9]["topk_ids"].shape == (0, K)


def test_dense_targets_sit_at_their_positions_and_drop_what_packing_cut():
    ids, logprobs = dense_targets(SCORED[0], length=3, k=K)  # position 3 is past a row cut to 3 tokens
    assert ids.tolist() == [[-1, -1], [5, 6], [-1, -1]]
    assert logprobs.tolist() == [[0.0, 0.0], [-0.5, -1.25], [0.0, 0.0]]
    assert ids.dtype == torch.long and logprobs.dtype == torch.float32
    ids, _ = dense_targets(SCORED[0], length=5, k=K)
    assert ids[3].tolist() == [7, 8]


class Entries:
    """TeacherEntries' interface over a dict (the real one reads a corpus split's shards)."""

    k = K

    def __init__(self, rows):
        self.rows = rows

    def get(self, row_id):
        return self.rows.get(row_id)


def test_packed_rows_get_each_examples_targets_at_its_offset():
    entries = Entries({7: SCORED[0], 9: SCORED[1],
                       4: {"skipped": "", "positions": [0], "topk_ids": [1, 2], "topk_logprobs": [-1.0, -3.0]}})
    # row 0: example 7 starts at offset 2; row 1: a skipped row, an example without an id, one never scored
    packed = [[{"id": 4, "input_ids": [0, 0]}, {"id": 7, "input_ids": [0, 0, 0, 0]}],
              [{"id": 9, "input_ids": [0]}, {"input_ids": [0, 0]}, {"id": 5, "input_ids": [0]}]]
    out = teacher_tensors(packed, entries, width=7)
    assert out["teacher_ids"].shape == (2, 7, K)
    expected = torch.full((2, 7, K), -1)
    expected[0, 0] = torch.tensor([1, 2])
    expected[0, 2 + 1] = torch.tensor([5, 6])
    expected[0, 2 + 3] = torch.tensor([7, 8])
    assert torch.equal(out["teacher_ids"], expected)
    assert out["teacher_logprobs"][0, 3].tolist() == [-0.5, -1.25]
    assert out["teacher_logprobs"][0, 0].tolist() == [-1.0, -3.0]
    assert out["teacher_logprobs"][1].abs().sum() == 0
