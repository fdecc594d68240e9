"""The distillation loss: KL over the teacher's top-k is 0 when the student is the (renormalised) teacher, positive
otherwise and equal to a hand-computed value; α picks CE or KL exactly; only the student gets gradients; positions
without a teacher entry count in the CE only."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pipelines.format.rows import IGNORE
from pipelines.train.distill import distillation_loss

V, K = 16, 4


def batch(seed: int = 0, B: int = 2, T: int = 6):
    """Student logits, labels (prompt of 2 ignored), and a teacher's top-k entries aligned with the labels."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[:, :2] = IGNORE
    teacher_full = torch.randn(B, T, V, generator=g).log_softmax(-1)
    logprobs, ids = teacher_full.topk(K, dim=-1)  # (B, T, k)
    ids[labels == IGNORE] = -1  # no entry on the prompt
    return logits, labels, ids, logprobs


def test_kl_is_zero_when_the_student_is_the_renormalised_teacher_and_positive_otherwise():
    logits, labels, ids, logprobs = batch()
    assert distillation_loss(logits, labels, ids, logprobs, alpha=1.0).kl > 0.1
    student = torch.full_like(logits, -1e4)  # no mass outside the teacher's top-k
    renormalised = logprobs.log_softmax(-1)  # (B, T, k)
    # the student's logits at t-1 are compared with the teacher's entry t
    student[:, :-1].scatter_(-1, ids[:, 1:].clamp(min=0), renormalised[:, 1:])
    kl = distillation_loss(student, labels, ids, logprobs, alpha=1.0).kl
    assert kl.abs() < 1e-5


def test_kl_matches_a_hand_computed_value_on_three_tokens():
    """Vocabulary of 3; the teacher's top-2 are ids 0 and 1 with p = 0.6, 0.3 (renormalised: 2/3, 1/3); the
    student is uniform (q = 1/3). KL = 2/3 ln(2/3 / 1/3) + 1/3 ln(1/3 / 1/3) = 2/3 ln 2."""
    logits = torch.zeros(1, 2, 3)
    labels = torch.tensor([[IGNORE, 0]])
    ids = torch.tensor([[[-1, -1], [0, 1]]])
    logprobs = torch.tensor([[[0.0, 0.0], [math.log(0.6), math.log(0.3)]]])
    out = distillation_loss(logits, labels, ids, logprobs, alpha=0.5)
    assert out.kl.item() == pytest.approx(2 / 3 * math.log(2), rel=1e-6)
    assert out.ce.item() == pytest.approx(math.log(3), rel=1e-6)
    assert out.total.item() == pytest.approx(0.5 * 2 / 3 * math.log(2) + 0.5 * math.log(3), rel=1e-6)
    # temperature 2: both sides softened, p̃ ∝ (0.6, 0.3)^(1/2); the student stays uniform; scaled by τ² = 4
    p = torch.tensor([0.6, 0.3]).sqrt()
    p = p / p.sum()
    expected = 4 * float((p * (p / (1 / 3)).log()).sum())
    assert distillation_loss(logits, labels, ids, logprobs, alpha=1.0, temperature=2.0).kl.item() == pytest.approx(
        expected, rel=1e-6)


def test_alpha_zero_is_exactly_cross_entropy_and_alpha_one_the_kl_alone():
    logits, labels, ids, logprobs = batch(1)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1), ignore_index=IGNORE)
    zero, one = (distillation_loss(logits, labels, ids, logprobs, alpha=a) for a in (0.0, 1.0))
    assert torch.equal(zero.total, ce) and torch.equal(zero.ce, ce)
    assert torch.equal(one.total, one.kl) and one.kl > 0
    half = distillation_loss(logits, labels, ids, logprobs, alpha=0.25)
    assert torch.allclose(half.total, 0.25 * one.kl + 0.75 * ce)


def test_gradients_reach_the_student_logits_only():
    logits, labels, ids, logprobs = batch(2)
    logits.requires_grad_(True)
    logprobs.requires_grad_(True)
    distillation_loss(logits, labels, ids, logprobs, alpha=0.5).total.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    assert logprobs.grad is None


def test_positions_without_a_teacher_entry_count_in_the_ce_only():
    logits, labels, ids, logprobs = batch(3)
    full = distillation_loss(logits, labels, ids, logprobs, alpha=0.5)
    missing = ids.clone()
    missing[:, 3] = -1  # the teacher skipped position 3 (its garbage log-probs must not matter)
    garbage = logprobs.clone()
    garbage[:, 3] = 5.0
    out = distillation_loss(logits, labels, missing, garbage, alpha=0.5)
    assert torch.equal(out.ce, full.ce) and not torch.allclose(out.kl, full.kl)
    # the KL is the mean over the remaining entries (t = 2, 4, 5; two rows each), each position scored alone
    alone = [distillation_loss(logits[:, t - 1 : t + 1], labels[:, t - 1 : t + 1], ids[:, t - 1 : t + 1],
                               logprobs[:, t - 1 : t + 1], alpha=1.0).kl for t in (2, 4, 5)]
    assert torch.allclose(out.kl, torch.stack(alone).mean())
    logits.requires_grad_(True)
    none = distillation_loss(logits, labels, torch.full_like(ids, -1), logprobs, alpha=1.0)
    assert none.kl.item() == 0.0
    none.total.backward()  # no entry at all: a zero loss still in the graph


def test_bad_alpha_or_temperature_is_refused():
    logits, labels, ids, logprobs = batch()
    with pytest.raises(ValueError, match="alpha"):
        distillation_loss(logits, labels, ids, logprobs, alpha=1.5)
    with pytest.raises(ValueError, match="temperature"):
        distillation_loss(logits, labels, ids, logprobs, alpha=0.5, temperature=0)
