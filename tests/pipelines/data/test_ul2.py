"""UL2 data: the byte tokenizer and the R/S/X denoisers, checked by reconstructing the text."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.data.ul2 import MIXTURES, Denoiser, denoise, prefix_lm, span_corruption
from pipelines.format.tokenizer import UL2_SENTINELS, UL2_SPECIALS, load_tokenizer, ul2_vocab, write_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(directory)
    return load_tokenizer(directory, vocab_size=512)


def test_byte_tokenizer_round_trips_any_text_within_512_ids(tokenizer):
    text = "def f(x):\n    return x ** 2  # ünïcödé, 漢字, \t tabs\n"
    ids = tokenizer.encode(text).ids
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert ids[:3] == list(b"def")  # ids 0-255 are the bytes themselves
    assert tokenizer.decode(ids) == text
    vocab = ul2_vocab(tokenizer)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 256 + len(UL2_SPECIALS) + UL2_SENTINELS <= 512
    assert len({vocab.pad, vocab.start, vocab.eos, *vocab.modes.values(), *vocab.sentinels}) == 6 + UL2_SENTINELS
    assert min(vocab.sentinels) >= 256


def reconstruct(inputs: list[int], targets: list[int], vocab) -> list[int]:
    """Puts each sentinel's hidden tokens back in its place."""
    hidden, current = {}, None
    for t in targets[:-1]:
        if t in vocab.sentinels:
            current = t
            hidden[t] = []
        else:
            hidden[current].append(t)
    out = []
    for t in inputs[1:]:
        out += hidden[t] if t in vocab.sentinels else [t]
    return out


@pytest.mark.parametrize("mean_span,density", [(3, 0.15), (8, 0.5), (64, 0.15)])
def test_span_corruption_hides_spans_that_reconstruct_the_text(tokenizer, mean_span, density):
    vocab = ul2_vocab(tokenizer)
    tokens = np.asarray(tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6).ids)
    hidden_fractions, spans = [], []
    for seed in range(20):
        inputs, targets = span_corruption(tokens, Denoiser("X", mean_span, density), vocab, np.random.default_rng(seed))
        assert inputs[0] == vocab.modes["X"] and targets[-1] == vocab.eos
        assert reconstruct(inputs, targets, vocab) == tokens.tolist()
        n_spans = sum(t in vocab.sentinels for t in targets)
        assert n_spans == sum(t in vocab.sentinels for t in inputs) >= 1
        hidden_fractions.append((len(targets) - 1 - n_spans) / len(tokens))
        spans.append((len(targets) - 1 - n_spans) / n_spans)
    assert abs(np.mean(hidden_fractions) - density) < 0.02
    assert 0.5 * mean_span < np.mean(spans) < 1.5 * mean_span


def test_prefix_lm_splits_into_prefix_and_continuation(tokenizer):
    vocab = ul2_vocab(tokenizer)
    tokens = np.arange(40)
    inputs, targets = prefix_lm(tokens, vocab, np.random.default_rng(0))
    assert inputs[0] == vocab.modes["S"] and targets[-1] == vocab.eos
    assert inputs[1:] + targets[:-1] == tokens.tolist() and len(inputs) > 1 and len(targets) > 1


def test_ul2_mixture_draws_every_denoiser_by_weight(tokenizer):
    vocab, rng = ul2_vocab(tokenizer), np.random.default_rng(0)
    modes = [denoise(np.arange(100), vocab, MIXTURES["ul2"], rng)[2] for _ in range(1000)]
    counts = {m: modes.count(m) / len(modes) for m in "RSX"}
    assert abs(counts["R"] - 0.4) < 0.05 and abs(counts["X"] - 0.4) < 0.05 and abs(counts["S"] - 0.2) < 0.05
