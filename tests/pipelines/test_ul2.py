"""UL2: the byte tokenizer, the R/S/X denoisers (checked by reconstructing the text), and the job end to end through
Ray Train + DeepSpeed ZeRO-3 on 2 CPU workers: the loss falls, the exports reload, the encoder serves Awareness."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.ul2 import (MIXTURES, SENTINELS, SPECIALS, Denoiser, Ul2Config, Ul2DataConfig, denoise,
                           load_tokenizer, parse_ul2_config, prefix_lm, source_files, span_corruption, ul2_vocab,
                           write_byte_tokenizer)

ROOT = Path(__file__).resolve().parents[2]


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
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 256 + len(SPECIALS) + SENTINELS <= 512
    assert len({vocab.pad, vocab.start, vocab.eos, *vocab.modes.values(), *vocab.sentinels}) == 6 + SENTINELS
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


def test_config_errors_are_collected_and_name_the_fix(tmp_path):
    with pytest.raises(ValueError) as error:
        parse_ul2_config(["--data.mixture", "bert", "--model.encoder_key_rope", "alibi",
                          "--model.checkpoint", str(tmp_path / "nope")], Ul2Config())
    for expected in ("data.mixture", "encoder_key_rope", "is not a directory"):
        assert expected in str(error.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        source_files(Ul2DataConfig(paths=str(tmp_path / "missing")))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path, 512)


def test_encoder_ul2_job_through_ray_train(tmp_path, checkpoint_root):
    """A few steps of the job as a user runs it (Ray Train, ZeRO-3 over gloo on 2 CPU workers, MLflow): the loss
    falls, the exported seq2seq model and encoder reload, and the encoder serves as the Awareness memory encoder."""
    from models import Qwen3EncoderModel, Qwen3ForSeq2SeqLM, build_pair

    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "encoder_ul2.py"), "--train.max_steps", "8", "--train.log_every", "1",
         "--train.checkpoint_every", "8", "--train.memories_per_step", "8", "--train.warmup_steps", "2",
         "--data.seq_len", "64", "--data.mixture", "span", "--data.paths", str(ROOT / "models"),
         "--model.checkpoint_root", str(tmp_path / "ckpt"), "--run.storage_path", str(tmp_path / "ray")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 8 and summary["error"] is None and summary["mlflow_run_id"]
    assert summary["loss_last"] < summary["loss_first"] - 0.2, summary  # 8 steps: ~5.7 -> ~5.3 (ln 512 = 6.2)
    assert (tmp_path / "mlflow.db").is_file()
    seq2seq = Qwen3ForSeq2SeqLM.from_pretrained(summary["seq2seq"]).eval()
    encoder = Qwen3EncoderModel.from_pretrained(summary["encoder"]).eval()
    tok = load_tokenizer(summary["encoder"], 512)
    ids = torch.tensor([tok.encode("def forward(self, x):").ids])
    with torch.no_grad():
        want = seq2seq.encoder(input_ids=ids).last_hidden_state
        torch.testing.assert_close(encoder(input_ids=ids).last_hidden_state, want)
        assert seq2seq.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 5)
    aware = build_pair("tiny", checkpoint_root=checkpoint_root, encoder_checkpoint=summary["encoder"]).eval()
    with torch.no_grad():
        states, _ = aware.memory_encoder(ids)
    torch.testing.assert_close(states, want, atol=1e-5, rtol=1e-5)
