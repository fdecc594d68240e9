"""The token prior (memory_lexical_tokens): each query token scores up the chunks holding its own token, so a key the
decoder names is read next."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from models import MemoryReading, build_pair, gca_parameter_count
from models.gca import AnswerSoFar, GCAMemory
from models.lexical import NO_TOKEN, TokenIndex, answer_windows
from pipelines.evaluate.probes import gca_blocks, memory_attention, memory_attention_probe
from tests.conftest import random_ids
from tests.models.test_awareness import cached_logits
from tests.models.test_fusion import DEC_VOCAB, logits, memory_batch
from tests.models.test_lexical import (ASKED, answered_rows, assert_greedy_is_the_argmax_of_answered_forwards, idf,
                                      needle_memory, reloaded_reading_alike, train_on_the_answer)
from tests.models.test_routing import routed_pair

NAMED = ASKED + 1  # a second rare token, the key an answer names


def test_each_token_gets_its_idf_on_the_chunks_holding_it():
    chunks = torch.tensor([[[5, 7, 1, 1], [7, 2, 2, 2], [3, 3, 3, 3], [5, 0, 0, 0]],
                           [[4, 4, 4, 4], [4, 4, 4, 4], [6, 4, 4, 4], [4, 4, 4, 4]]])  # (2, C=4, L=4)
    mask = torch.ones_like(chunks, dtype=torch.bool)
    mask[0, 3] = False  # chunk 3 of memory 0 is padding
    ids = torch.tensor([[5, 7, 9, 2, 5], [6, 4, 5, 7, 6]])  # (B_mem, Q): 9 nowhere; memory 1 has only 4 and 6
    prior = TokenIndex.of(chunks, mask).prior(ids)
    five, seven, two = idf(3, 1), idf(3, 2), idf(3, 1)
    expected = torch.zeros(2, 5, 4)
    expected[0, 0, 0] = expected[0, 4, 0] = five
    expected[0, 1, :2] = seven
    expected[0, 3, 1] = two
    expected[1, 0, 2] = expected[1, 4, 2] = idf(4, 1)
    expected[1, 1] = idf(4, 4)  # in every chunk: about 0
    torch.testing.assert_close(prior, expected)


def test_each_position_reads_the_chunk_holding_its_own_token(checkpoint_root):
    """k = 1, a heavy weight: the question names two rare tokens, so its prior ties their chunks; with the token
    prior the position reading ASKED reads ASKED's chunk and the one reading NAMED reads NAMED's, wherever they are.
    Without it the random routers break the tie, wrongly for some."""
    _, routed = routed_pair(checkpoint_root, "gca", k=1, lexical_routing=100.0, lexical_tokens=True)
    where, named_at = [0, 1, 2, 3], [2, 3, 0, 1]
    mem = needle_memory(0, where)
    for row, chunk in enumerate(named_at):
        mem[row, chunk, 5] = NAMED
    ones = torch.ones(len(where), 1, dtype=torch.long)
    for last, chunks in ((ASKED, where), (NAMED, named_at)):
        other = NAMED if last == ASKED else ASKED
        prompt = torch.cat([ones, ones * other, ones * last], dim=1)
        for layer in memory_attention(routed, input_ids=prompt, memory_input_ids=mem):  # (B, H, M)
            mass = layer.view(len(where), layer.shape[1], 4, 8).sum(-1)  # (B, H, C)
            for row, chunk in enumerate(chunks):
                torch.testing.assert_close(mass[row, :, chunk], torch.ones(layer.shape[1]))
    routed.reading = replace(routed.reading, lexical_tokens=False)
    missed = []
    for last, chunks in ((ASKED, where), (NAMED, named_at)):
        other = NAMED if last == ASKED else ASKED
        prompt = torch.cat([ones, ones * other, ones * last], dim=1)
        for layer in memory_attention(routed, input_ids=prompt, memory_input_ids=mem):
            read = layer.view(len(where), layer.shape[1], 4, 8).sum(-1).argmax(-1)  # (B, H)
            missed.append((read != torch.tensor(chunks)[:, None]).any())
    assert any(missed)  # the question's prior ties the two chunks: the routers pick one for both positions


def gated_tokens(checkpoint_root, k: int = 2, window: int = 1, reading_window: int | None = None,
                 carry: float = 1.0):
    _, routed = routed_pair(checkpoint_root, "gca", k=k, chunk_weights="router", lexical_routing=2.0,
                            lexical_gate=True, lexical_tokens=True, lexical_window=window,
                            lexical_reading_window=reading_window, lexical_window_carry=carry)
    with torch.no_grad():
        for n, block in enumerate(routed.memory_readers().values()):
            gate = block.lexical_gate
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(n)))
    return routed


def test_cached_decoding_and_generate_equal_full_forwards_and_it_is_saved(checkpoint_root, tmp_path):
    """Each step's prior is its own token's: cached decoding equals a full forward (labels marking the continuation
    as the answer), greedy generate is the argmax of full forwards, and a saved model reads the same; the answer's
    loss reaches both gate outputs."""
    routed = gated_tokens(checkpoint_root)
    mem, mask = memory_batch(chunks=4)
    prompt, continuation, ids, labels = answered_rows(mem)  # the answer names chunk 0's tokens: its prior moves there
    full = logits(routed, ids, mem, mask, labels=labels)
    torch.testing.assert_close(cached_logits(routed, prompt, continuation, mem, mask), full, rtol=1e-4, atol=1e-5)
    without = replace(routed.reading, lexical_tokens=False)
    routed.reading, with_tokens = without, routed.reading
    assert not torch.allclose(logits(routed, ids, mem, mask, labels=labels), full, rtol=1e-4, atol=1e-5)
    routed.reading = with_tokens
    assert_greedy_is_the_argmax_of_answered_forwards(routed, prompt, mem, mask)
    assert reloaded_reading_alike(routed, tmp_path / "run", ids, mem, mask, labels, full).reading.lexical_tokens
    train_on_the_answer(routed, ids, mem, mask, labels)
    for block in routed.memory_readers().values():
        assert (block.lexical_gate.weight.grad.abs().sum(-1) > 0).all()  # both outputs learn


def test_k_keeping_every_chunk_is_still_full_attention(checkpoint_root):
    full, routed = routed_pair(checkpoint_root, "gca", k=4, lexical_routing=5.0, lexical_tokens=True)
    mem, mask = memory_batch(chunks=4)
    ids = torch.cat([random_ids(2, 3, vocab=DEC_VOCAB, seed=2), mem[:, 1, :3]], dim=1)
    torch.testing.assert_close(logits(routed, ids, mem, mask), logits(full, ids, mem, mask), rtol=1e-5, atol=1e-5)


def test_refusals_and_the_gates_are_counted():
    with pytest.raises(ValueError, match="lexical_tokens"):
        MemoryReading(top_k=2, lexical_tokens=True).check("gca")
    with pytest.raises(ValueError, match="lexical_window"):
        MemoryReading(top_k=2, lexical_routing=1.0, lexical_window=3).check("gca")
    one_gate = build_pair("tiny", device="meta", reading=MemoryReading(top_k=2, lexical_routing=1.0,
                                                                       lexical_gate=True))
    with pytest.raises(ValueError, match="built for the question's prior alone"):
        one_gate.reading = replace(one_gate.reading, lexical_tokens=True)
    one_gate.reading = replace(one_gate.reading, lexical_tokens=True, lexical_gate=False)  # ungated: it may
    added = {}
    for tokens in (False, True):
        model = build_pair("tiny", device="meta", reading=MemoryReading(top_k=2, lexical_routing=1.0,
                                                                        lexical_gate=True, lexical_tokens=tokens))
        added[tokens] = sum(p.numel() for n, p in model.named_parameters() if ".cross_attention." in n)
    d = model.decoder.config
    shape = dict(hidden_size=d.hidden_size, num_heads=d.num_attention_heads, num_kv_heads=d.num_key_value_heads,
                 head_dim=d.head_dim, num_gca_layers=len(model.gca_layers), encoder_hidden_size=d.hidden_size,
                 router=True, lexical_gate=True)
    assert added[True] - added[False] == len(model.gca_layers) * (d.hidden_size + 1)
    assert added[True] - added[False] == (gca_parameter_count(**shape, lexical_tokens=True)
                                          - gca_parameter_count(**shape))


def test_an_answer_tokens_window_holds_its_answers_last_tokens_and_a_question_token_its_own():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    answer = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 1, 1]], dtype=torch.bool)  # row 1: two answers
    x = NO_TOKEN
    assert answer_windows(ids, answer, 3).tolist() == [
        [[x, x, 10], [x, x, 11], [x, x, 12], [x, 12, 13], [12, 13, 14], [13, 14, 15]],
        [[x, x, 20], [x, x, 21], [x, 21, 22], [x, x, 23], [x, x, 24], [x, 24, 25]]]
    # a decoding step: one token a row, after the answer tokens the rows fed before (row 0: one; row 1: none)
    step = answer_windows(torch.tensor([[7], [8]]), torch.ones(2, 1, dtype=torch.bool), 3,
                          torch.tensor([[x, x, 5], [x, x, x]]))
    assert step.tolist() == [[[x, 5, 7]], [[x, x, 8]]]
    assert torch.equal(answer_windows(ids, answer, 1), ids[..., None])


def test_the_carry_weighs_the_earlier_answer_tokens_priors_down():
    """memory_lexical_window_carry, by hand: chunks [5 1] [6 1] [7 1]; the question 9 (in no chunk), the answer 5 6 7
    with a window of 2. Each answer token's prior on a chunk is the larger of its own token's idf there and carry
    times the token before's; the question token's is its own."""
    chunks = torch.tensor([[[5, 1], [6, 1], [7, 1]]])
    ids = torch.tensor([[9, 5, 6, 7]])
    i = idf(3, 1)
    for carry in (1.0, 0.5):
        routing = SimpleNamespace(token_prior=None)
        memory = GCAMemory(layers={0: SimpleNamespace(routing=routing)}, states=torch.zeros(1, 6, 4),
                           mask=torch.ones(1, 6, dtype=torch.bool),
                           chunk_ids=(chunks, torch.ones_like(chunks, dtype=torch.bool)),
                           answer=AnswerSoFar(fed=torch.tensor([[False, True, True, True]])))
        memory.hold_tokens(ids, 2.0, window=2, carry=carry)
        expected = 2 * torch.tensor([[[0, 0, 0], [i, 0, 0], [carry * i, i, 0], [0, carry * i, i]]])
        torch.testing.assert_close(routing.token_prior, expected)
    with pytest.raises(ValueError, match="lexical_window_carry"):
        MemoryReading(top_k=2, lexical_routing=1.0, lexical_tokens=True, lexical_window=2,
                      lexical_window_carry=0.0).check("gca")


def test_a_named_key_keeps_its_chunk_read_through_the_tokens_after_it(checkpoint_root):
    """k = 1, a heavy weight: the answer names a rare key, then a token every chunk holds. With a window of 3 the
    positions after the key still read the key's chunk; with each token its own, the question's prior ties the key's
    chunk with the asked one there and the random routers read the other for some rows."""
    _, routed = routed_pair(checkpoint_root, "gca", k=1, lexical_routing=100.0, lexical_tokens=True,
                            lexical_window=3)
    where = [0, 1, 2, 3]
    mem = needle_memory(0, [(c + 1) % 4 for c in where])  # the question's token elsewhere
    common = mem[0, 0, 0].item()
    mem[:, :, 0] = common  # in every chunk
    for row, chunk in enumerate(where):
        mem[row, chunk, 5] = NAMED
    ones = torch.ones(len(where), 1, dtype=torch.long)
    # the question names both rare tokens, so its prior ties their chunks; the answer: NAMED common common
    ids = torch.cat([ones * ASKED, ones * NAMED, ones * NAMED, ones * common, ones * common], dim=1)
    labels = torch.cat([torch.full((len(where), 2), -100), ids[:, 2:]], dim=1)
    missed = {}
    for window in (3, 1):
        routed.reading = replace(routed.reading, lexical_window=window)
        missed[window] = []
        with torch.no_grad(), memory_attention_probe(gca_blocks(routed)) as seen:
            routed(input_ids=ids, labels=labels, memory_input_ids=mem)
        for layer in seen.values():  # (B_mem, H, T, M): one row a memory
            mass = layer.view(len(where), layer.shape[1], -1, 4, 8).sum(-1)  # (B, H, T, C)
            read = mass[:, :, 2:].argmax(-1)  # (B, H, 3): NAMED and the two tokens after it
            missed[window].append((read != torch.tensor(where)[:, None, None]).any())
    assert not any(missed[3])
    assert any(missed[1])


def test_windowed_cached_decoding_generate_and_beams_equal_full_forwards_and_it_is_saved(checkpoint_root, tmp_path):
    """memory_lexical_window: cached decoding equals a full forward whose labels mark the continuation as the answer,
    greedy generate is the argmax of such forwards, beam search keeps each beam's own answer, a saved model reads the
    same, and the window changes what the model reads."""
    routed = gated_tokens(checkpoint_root, window=3)
    mem, mask = memory_batch(chunks=4)
    prompt = answered_rows(mem)[0]
    continuation = torch.cat([mem[:, 0, :1], mem[:, 1, :1], mem[:, 3, :2]], dim=1)  # each token from its own chunk
    ids = torch.cat([prompt, continuation], dim=1)
    labels = torch.cat([torch.full_like(prompt, -100), continuation], dim=1)
    full = logits(routed, ids, mem, mask, labels=labels)
    torch.testing.assert_close(cached_logits(routed, prompt, continuation, mem, mask), full, rtol=1e-4, atol=1e-5)
    with torch.no_grad():  # a memory given its question by with_question: its first forward is the question too
        memory = routed.with_question(routed.prepare_memory(mem, mask), prompt, torch.ones_like(prompt))
    torch.testing.assert_close(cached_logits(routed, prompt, continuation, memory=memory), full, rtol=1e-4, atol=1e-5)
    routed.reading, windowed = replace(routed.reading, lexical_window=1), routed.reading
    assert not torch.allclose(logits(routed, ids, mem, mask, labels=labels), full, rtol=1e-4, atol=1e-5)
    routed.reading = windowed
    assert_greedy_is_the_argmax_of_answered_forwards(routed, prompt, mem, mask)
    beams = routed.generate(prompt, memory_input_ids=mem, memory_attention_mask=mask, max_new_tokens=4, num_beams=3,
                            num_return_sequences=3, do_sample=False, eos_token_id=None, pad_token_id=0,
                            output_scores=True, return_dict_in_generate=True)
    for row, sequence, score in zip(range(6), beams.sequences, beams.sequences_scores):
        answered = torch.cat([torch.full((prompt.shape[1],), -100), sequence[prompt.shape[1]:]])[None]
        step = logits(routed, sequence[None, :-1], mem[row // 3: row // 3 + 1], mask[row // 3: row // 3 + 1],
                      labels=answered[:, :-1])
        logprobs = step[0, prompt.shape[1] - 1:].log_softmax(-1).gather(-1, sequence[prompt.shape[1]:, None])
        torch.testing.assert_close(logprobs.sum() / 4, score, rtol=1e-4, atol=1e-4)  # length_penalty 1
    assert reloaded_reading_alike(routed, tmp_path / "run", ids, mem, mask, labels, full).reading.lexical_window == 3


def test_the_reading_window_holds_in_eval_mode_only_and_is_saved(checkpoint_root, tmp_path):
    """memory_lexical_reading_window: in eval mode the model reads as one built with that window, in training as one
    built with memory_lexical_window; saved and loaded, it reads the same, its carry too."""
    routed = gated_tokens(checkpoint_root, reading_window=3, carry=0.75)
    mem, mask = memory_batch(chunks=4)
    prompt = answered_rows(mem)[0]
    continuation = torch.cat([mem[:, 0, :1], mem[:, 1, :1], mem[:, 3, :2]], dim=1)
    ids = torch.cat([prompt, continuation], dim=1)
    labels = torch.cat([torch.full_like(prompt, -100), continuation], dim=1)
    built = routed.reading

    def read(model, training: bool, **reading) -> torch.Tensor:
        model.reading = replace(built, **reading)
        model.train(training)
        with torch.no_grad():
            out = model(input_ids=ids, labels=labels, memory_input_ids=mem, memory_attention_mask=mask)
        model.reading = built
        return out.loss

    reading_window = read(routed, False)
    torch.testing.assert_close(reading_window, read(routed, False, lexical_window=3, lexical_reading_window=None))
    assert not torch.allclose(reading_window, read(routed, False, lexical_reading_window=None))
    torch.testing.assert_close(read(routed, True), read(routed, True, lexical_reading_window=None))
    assert not torch.allclose(reading_window, read(routed, False, lexical_window_carry=1.0))  # the carry reads
    routed.eval()
    full = logits(routed, ids, mem, mask, labels=labels)
    assert reloaded_reading_alike(routed, tmp_path / "run", ids, mem, mask, labels, full).reading == built
