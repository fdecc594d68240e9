"""The dense retriever (models/retriever.py): its loss against a hand-computed case, its embedding against the
memory encoder's own states, padding that changes nothing, and an export that reloads to the same scores."""

from __future__ import annotations

import math

import pytest
import torch

from models import build_pair
from models.retriever import DenseRetriever, contrastive_loss, padded_rows, top_k


def test_contrastive_loss_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 3.0]])
    positives = torch.tensor([[True, False, False], [False, True, True]])
    # question 0: chunk 0 against chunks 1 and 2; question 1: chunk 1 against chunk 0, and chunk 2 against chunk 0
    pairs = [-math.log(math.exp(2) / (math.exp(2) + math.exp(1) + math.exp(0))),
             -math.log(math.exp(1) / (math.exp(1) + math.exp(0))),
             -math.log(math.exp(3) / (math.exp(3) + math.exp(0)))]
    assert contrastive_loss(logits, positives).item() == pytest.approx(sum(pairs) / 3, rel=1e-6)
    # a question whose every chunk is evidence has no negative: nothing to separate, no loss
    assert contrastive_loss(logits[:1], torch.ones(1, 3, dtype=torch.bool)).item() == pytest.approx(0.0)


@pytest.fixture(scope="module")
def retriever(checkpoint_root) -> DenseRetriever:
    pair = build_pair("tiny-shared", checkpoint_root=checkpoint_root)
    return DenseRetriever(pair.memory_encoder.encoder, "bidirectional").eval()


def test_embedding_is_the_encoders_mean_state_and_padding_changes_nothing(retriever):
    rows = [[5, 9, 11, 12], [7, 8]]
    ids, mask = padded_rows(rows)
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    with torch.no_grad():
        embedded = retriever.embed(ids, mask)
        for row, got in zip(rows, embedded, strict=True):
            states, _ = retriever.memory(torch.tensor([[row]]))  # the row alone, no padding
            want = torch.nn.functional.normalize(states[0].mean(0), dim=-1)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(embedded.norm(dim=-1), torch.ones(2))
    scores = retriever.scores([[5, 9, 11, 12], [7, 8], [1, 2, 3]], [[7, 8]])
    assert scores.shape == (1, 3) and scores[0].argmax().item() == 1  # a chunk equal to the query ranks first


def test_export_reloads_to_the_same_scores(retriever, tmp_path):
    retriever.save_pretrained(tmp_path / "export")
    assert sorted(p.name for p in (tmp_path / "export").iterdir() if p.suffix != ".json") == ["model.safetensors"]
    loaded = DenseRetriever.from_pretrained(tmp_path / "export")
    chunks, queries = [[3, 4, 5], [6, 7, 8, 9], [10]], [[4], [9, 6]]
    torch.testing.assert_close(loaded.scores(chunks, queries), retriever.scores(chunks, queries))
    with pytest.raises(FileNotFoundError, match="retriever.json"):
        DenseRetriever.from_pretrained(tmp_path)


def test_top_k_ranks_best_first_with_ties_in_memory_order():
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.1], [0.0, 0.0, 0.0, 0.0]])
    assert top_k(scores, 3) == [[1, 0, 2], [0, 1, 2]]
    assert top_k(scores, 9) == [[1, 0, 2, 3], [0, 1, 2, 3]]  # more than the memory holds: every chunk
