"""The traffic VLM's held-out metrics (pipelines/evaluate/traffic.py) against scikit-learn's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import confusion_matrix, f1_score, precision_score, recall_score

from pipelines.data.traffic_scenes import QUESTION_TYPES, QUESTIONS
from pipelines.evaluate.traffic import count_outcomes, metrics_from_counts


def test_metrics_match_scikit_learn():
    rng = np.random.default_rng(0)
    types = QUESTION_TYPES
    kinds = rng.choice(len(types), 200)
    questions = [QUESTIONS[types[k]] for k in kinds]
    truth = torch.from_numpy(rng.random(200) < 0.45)
    seen = torch.where(torch.from_numpy(rng.random(200) < 0.8), truth, ~truth)
    withheld = torch.from_numpy(rng.random(200) < 0.5)
    metrics = metrics_from_counts(count_outcomes(seen, withheld, truth, questions, types), types)
    y, p = truth.numpy(), seen.numpy()
    assert metrics["accuracy"] == pytest.approx((y == p).mean())
    assert metrics["no_image_accuracy"] == pytest.approx((y == withheld.numpy()).mean())
    assert metrics["majority_accuracy"] == pytest.approx(max(y.mean(), 1 - y.mean()))
    assert metrics["f1"] == pytest.approx(f1_score(y, p))
    assert metrics["precision"] == pytest.approx(precision_score(y, p))
    assert metrics["recall"] == pytest.approx(recall_score(y, p))
    (tn, fp), (fn, tp) = confusion_matrix(y, p)
    assert [metrics[f"confusion/{k}"] for k in ("tp", "fp", "tn", "fn")] == [tp, fp, tn, fn]
    for i, kind in enumerate(types):
        assert metrics[f"accuracy/{kind}"] == pytest.approx((y == p)[kinds == i].mean())
