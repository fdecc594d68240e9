"""The traffic VLM's batches: rendered scenes' rows (png, question, answer; or a scene's questions together) as the
tensors the model reads, and the held-out scenes rendered once per process."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from pipelines.data.traffic_scenes import make_row, pixel_values
from pipelines.data.traffic_tokenizer import PAD, traffic_tokenizer


def collate(rows: dict[str, Any], image_size: int) -> dict[str, torch.Tensor]:
    """Columns png, question, answer -> pixel_values (B, 3, S, S) in [-1, 1], right-padded question ids and mask,
    labels (0 = YES, 1 = NO)."""
    encodings = traffic_tokenizer().encode_batch([str(q) for q in rows["question"]])
    return {"pixel_values": torch.from_numpy(pixel_values(list(rows["png"]), size=image_size)),
            "input_ids": torch.tensor([e.ids for e in encodings]),
            "attention_mask": torch.tensor([e.attention_mask for e in encodings]),
            "labels": torch.tensor([0 if a == "yes" else 1 for a in rows["answer"]])}


def collate_scene_questions(rows: dict[str, Any], image_size: int, rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Columns png, scene_questions, scene_answers -> one row per scene asking all of its questions at once, in an
    order shuffled by `rng`: input_ids (B, T) of the questions one after another, each `[BOS] words`; position_ids
    restarting at 0 for each (and for the [PAD] tail); answer_positions (B, Q) of each question's last token;
    labels (B, Q), 0 = YES. No attention_mask: the model keeps each question's attention within itself.

    Why: a scene then trains Q answers for one pass of the vision tower and of the memory's K/V, and the answers
    of one image differ only by the question, which shortens the plateau before the decoder learns to look (the
    needle notes measured the same for text memories)."""
    tokenizer, pad = traffic_tokenizer(), traffic_tokenizer().token_to_id(PAD)
    ids, positions, answer_positions, labels = [], [], [], []
    for questions, answers in zip(rows["scene_questions"], rows["scene_answers"]):
        row_ids, row_positions, row_answers, row_labels = [], [], [], []
        for k in rng.permutation(len(questions)):
            question = tokenizer.encode(str(questions[k]), add_special_tokens=True).ids
            row_ids += question
            row_positions += range(len(question))
            row_answers.append(len(row_ids) - 1)
            row_labels.append(0 if answers[k] == "yes" else 1)
        ids.append(row_ids), positions.append(row_positions), answer_positions.append(row_answers)
        labels.append(row_labels)
    width = max(map(len, ids))
    for row_ids, row_positions in zip(ids, positions):
        tail = width - len(row_ids)
        row_ids += [pad] * tail
        row_positions += range(tail)  # the [PAD] tail is a segment of its own: no question attends to it
    return {"pixel_values": torch.from_numpy(pixel_values(list(rows["png"]), size=image_size)),
            "input_ids": torch.tensor(ids), "position_ids": torch.tensor(positions),
            "answer_positions": torch.tensor(answer_positions), "labels": torch.tensor(labels)}


@functools.lru_cache(maxsize=2)
def heldout_rows(seeds: tuple[int, ...], image_size: int, question_types: tuple[str, ...]) -> dict[str, list]:
    """Held-out scenes rendered by make_row, the function Ray Data renders the training scenes with; kept as PNG
    bytes for the run (a worker evaluates the same seeds every time)."""
    rows = [make_row(s, question_types=question_types) for s in seeds]
    return {key: [r[key] for r in rows] for key in ("png", "question", "answer", "seed")}
