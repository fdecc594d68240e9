"""models/loss.py: the chunked causal-LM loss against transformers' ForCausalLMLoss on full logits."""

import pytest
import torch
from torch import nn
from transformers.loss.loss_utils import ForCausalLMLoss

from models.loss import IGNORE_INDEX, causal_lm_loss
from tests.conftest import open_gates, random_ids

QWEN3_VOCAB = 151_936  # the real vocabulary: chunks of it must add up to transformers' loss
DEC_VOCAB, ENC_VOCAB = 512, 496


def labelled(batch: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    """Token labels with IGNORE prompts, as stage rows have, and a packed row's second example starting mid-row."""
    labels = random_ids(batch, length, vocab=vocab, seed=seed)
    labels[:, :5] = IGNORE_INDEX  # the first example's prompt
    labels[0, 20:26] = IGNORE_INDEX  # a packed second example's prompt
    labels[-1, -3:] = IGNORE_INDEX  # padding at the end
    return labels


def reference_and_chunked(hidden, head, labels, chunk_tokens):
    results = []
    for compute in (lambda h: ForCausalLMLoss(head(h), labels, vocab_size=head.out_features),
                    lambda h: causal_lm_loss(h, head, labels, chunk_tokens=chunk_tokens)):
        h = hidden.detach().clone().requires_grad_(True)
        head.zero_grad()
        loss = compute(h)
        loss.backward()
        results.append((loss.detach(), h.grad, head.weight.grad.clone()))
    return results


@pytest.mark.parametrize("chunk_tokens", [7, 64, 10_000])  # uneven chunks, several, and one chunk for all
def test_equals_transformers_loss_on_the_real_vocabulary(chunk_tokens):
    torch.manual_seed(0)
    head = nn.Linear(16, QWEN3_VOCAB, bias=False)
    hidden = torch.randn(2, 40, 16)
    labels = labelled(2, 40, QWEN3_VOCAB, seed=1)
    (want, want_h, want_w), (got, got_h, got_w) = reference_and_chunked(hidden, head, labels, chunk_tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_h, want_h, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(got_w, want_w, rtol=1e-4, atol=1e-8)


def test_keeps_no_full_vocabulary_logits():
    """Only a chunk's logits are alive: what autograd saves for backward is the hidden states, not (T, V)."""
    head = nn.Linear(16, QWEN3_VOCAB, bias=False)
    hidden = torch.randn(1, 64, 16, requires_grad=True)
    labels = random_ids(1, 64, vocab=QWEN3_VOCAB, seed=2)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        causal_lm_loss(hidden, head, labels, chunk_tokens=16)
    assert saved and max(saved) < 16 * QWEN3_VOCAB  # a full chunk's logits would be 16 x V; the whole batch 64 x V


def test_training_forward_uses_it_and_equals_the_decoder_loss(checkpoint_root, tiny):
    """AwarenessModel in training: the same loss and gradients as Qwen3ForCausalLM's own loss on full logits,
    plain and packed rows, the memory read through open gates."""
    model = open_gates(tiny).train()
    a, b = random_ids(1, 9, vocab=DEC_VOCAB, seed=6), random_ids(1, 7, vocab=DEC_VOCAB, seed=7)
    labels = torch.cat([a, b], dim=1)
    labels[0, :3], labels[0, 9:11] = IGNORE_INDEX, IGNORE_INDEX  # each example's prompt
    packed = dict(input_ids=torch.cat([a, b], dim=1), position_ids=torch.tensor([list(range(9)) + list(range(7))]),
                  segment_ids=torch.tensor([[0] * 9 + [1] * 7]),
                  memory_input_ids=random_ids(1, 5, 8, vocab=ENC_VOCAB, seed=8),
                  memory_attention_mask=torch.ones(1, 5, 8, dtype=torch.long),
                  memory_segment_ids=torch.tensor([[0, 0, 1, 1, 1]]))
    plain = dict(input_ids=random_ids(2, 12, vocab=DEC_VOCAB, seed=0),
                 memory_input_ids=random_ids(2, 3, 8, vocab=ENC_VOCAB, seed=1))
    for inputs, row_labels in ((plain, plain["input_ids"]), (packed, labels)):
        results = []
        for training in (False, True):  # eval mode: the decoder's own loss on its full logits
            model.train(training)
            model.zero_grad()
            out = model(**inputs, labels=row_labels)
            out.loss.backward()
            assert (out.logits is None) == training
            results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.grad is not None}))
        (want, want_grads), (got, got_grads) = results
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got_grads.keys() == want_grads.keys() and got_grads
        for name, grad in got_grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=1e-4, atol=1e-6, msg=name)
