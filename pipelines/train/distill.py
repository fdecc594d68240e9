"""The stage-4 distillation loss: α·KL(teacher‖student) over the teacher's stored top-k, plus (1−α)·CE.

Alignment follows transformers' causal-LM loss: `student_logits` (B, T, V) and `labels` (B, T) are aligned with the
student's input_ids, and position t's logits predict token t+1. The teacher's entries (pipelines.teachers.logits,
`dense_targets`) are aligned with the labels: entry t is the teacher's distribution for token t, so it is compared
with the student's logits at t−1, as labels[t] is. An entry whose first id is −1 is no entry (no teacher score for
that position: a prompt position, or a row the teacher skipped); those positions count in the CE only.

Renormalisation. Only the teacher's top-k survive, so the teacher's k probabilities are renormalised to sum to 1
(p̃ = softmax over the k stored log-probs, divided by τ), and the student keeps its log-softmax over the full
vocabulary, gathered at the k ids (log q, not renormalised). Then KL(p̃‖q) = Σ_k p̃ (log p̃ − log q) is a true
divergence: ≥ 0, and 0 only when the student's whole distribution is p̃ (so the mass it puts outside the teacher's
top-k is penalised, through Σ_k q < 1). The alternatives are worse: the unrenormalised teacher (Σ_k p < 1) gives a
term that can go negative and is not minimised at q = p; renormalising the student over the k ids too would let it
put any mass outside them for free. The cost is a bias: the teacher's tail (typically a few % of its mass at k=32)
is moved onto its top-k. With a temperature τ ≠ 1 both sides are softened (stored log-probs / τ, renormalised;
student logits / τ) and the KL is scaled by τ² so its gradients keep their size (Hinton et al.).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from pipelines.format.rows import IGNORE


class DistillLoss(NamedTuple):
    total: torch.Tensor  # α·kl + (1−α)·ce, what backward runs on
    kl: torch.Tensor  # mean KL(teacher‖student) over positions with a teacher entry (0 when there are none)
    ce: torch.Tensor  # mean cross-entropy over labelled positions, as F.cross_entropy(ignore_index=-100)


def distillation_loss(student_logits: torch.Tensor, labels: torch.Tensor, teacher_ids: torch.Tensor,
                      teacher_logprobs: torch.Tensor, alpha: float, temperature: float = 1.0) -> DistillLoss:
    """student_logits (B, T, V), labels (B, T), teacher_ids (B, T, k) (−1: no entry), teacher_logprobs (B, T, k).
    The teacher's tensors are data: no gradient reaches them."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    logits = student_logits[:, :-1].float()  # (B, T-1, V): position t-1 predicts token t
    targets, ids = labels[:, 1:], teacher_ids[:, 1:].long()  # (B, T-1), (B, T-1, k)
    teacher = teacher_logprobs[:, 1:].detach().float()  # (B, T-1, k)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)
    has_entry = (ids[..., 0] >= 0) & (targets != IGNORE)  # (B, T-1)
    kl = top_k_kl(logits[has_entry], ids[has_entry], teacher[has_entry], temperature)  # over (N,) entries
    return DistillLoss(alpha * kl + (1.0 - alpha) * ce, kl, ce)


def top_k_kl(student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
             temperature: float) -> torch.Tensor:
    """Mean over N positions of KL(p̃‖q): student_logits (N, V), teacher_ids and teacher_logprobs (N, k)."""
    if student_logits.shape[0] == 0:
        return student_logits.sum() * 0.0  # no entry: zero, still in the graph
    teacher = (teacher_logprobs / temperature).log_softmax(-1)  # (N, k): log p̃, renormalised over the top-k
    student = (student_logits / temperature).log_softmax(-1).gather(-1, teacher_ids)  # (N, k): log q at the ids
    kl = (teacher.exp() * (teacher - student)).sum(-1)  # (N,)
    return kl.mean() * temperature**2
