"""The Serve app's continuous batching (pipelines/serving/decoding.py) against transformers' generate: rows that join a
running batch mid-answer (other prompt lengths, other memories, none), with every fusion, the MoE decoder and lexical
routing, answer as `generate` answers each of them alone; a seeded sample does not depend on its batch; a row whose
client leaves or whose time runs out stops alone; a failing forward fails its own rows and the loop goes on."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from models import MemoryReading
from models.gca import GCAMemory
from pipelines.serving.decoding import DecodingLoop, Question
from tests.conftest import random_ids
from tests.models.test_fusion import DEC_VOCAB, ENC_VOCAB, memory_batch, pair, reading

MAX_TOKENS = 10


def served(model, seed: int, chunks: int = 3):
    """A memory as the app holds one: its GCA keys/values prepared once."""
    ids, mask = memory_batch(b=1, chunks=chunks, seed=seed)
    return SimpleNamespace(gca_memory=model.prepare_memory(ids, mask))


def alone(model, q: Question) -> list[int]:
    """What transformers' generate answers for the question by itself (greedy), cut after the first end token."""
    ids = torch.tensor([q.ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, gca_memory=q.memory.gca_memory if q.memory else None,
                             max_new_tokens=q.max_tokens, do_sample=False, pad_token_id=0)
    new = out[0, ids.shape[1]:].tolist()
    return new[:new.index(EOS) + 1] if EOS in new else new


EOS = 7


def answer(loop: DecodingLoop, first: list[Question], later: list[Question], after: int = 3) -> None:
    """Submits `first`, and `later` once the first question holds `after` tokens (they join a running batch);
    returns when every question has ended."""
    ended = {id(q): threading.Event() for q in first + later}
    for q in first + later:
        q.on_done = lambda q: ended[id(q)].set()

    own = first[0].on_token

    def on_token(token):
        if own is not None:
            own(token)
        if len(first[0].tokens) == after:
            for q in later:
                loop.submit(q)

    first[0].on_token = on_token
    for q in first:
        loop.submit(q)
    assert all(e.wait(60) for e in ended.values())


@pytest.mark.parametrize("name,fusion", [("tiny", "gca"), ("tiny", "cross"), ("tiny", "merged"), ("tiny-moe", "gca")])
def test_rows_joining_a_running_batch_answer_as_generate_answers_each_alone(checkpoint_root, name, fusion):
    model = reading(pair(checkpoint_root, fusion, name=name))
    a, b = served(model, seed=1), served(model, seed=2)
    prompts = [random_ids(1, n, vocab=DEC_VOCAB, seed=10 + n)[0].tolist() for n in (5, 5, 8, 3, 6, 9)]
    first = [Question(prompts[0], a, MAX_TOKENS), Question(prompts[1], a, MAX_TOKENS), Question(prompts[2], b, 4)]
    later = [Question(prompts[3], a, MAX_TOKENS), Question(prompts[4], None, MAX_TOKENS),
             Question(prompts[5], a, MAX_TOKENS)]
    loop = DecodingLoop(model, [EOS], max_rows=8, lock=threading.Lock())
    answer(loop, first, later)
    for q in first + later:
        assert q.error is None and not q.expired
        assert q.tokens == alone(model, q)
    assert max(int(size) for size in loop.stats["sizes"]) == 6  # the late rows decoded beside the first ones
    assert loop.stats["prefills"] == 5  # a's two 5-token prompts as one prefill


def test_lexically_routed_rows_keep_their_own_question_prior_as_rows_join_and_leave(checkpoint_root):
    model = reading(pair(checkpoint_root, "gca", reading=MemoryReading(top_k=1, lexical_routing=50.0)))
    memory = served(model, seed=4, chunks=4)
    chunks = memory.gca_memory.chunk_ids[0][0]  # (C, L): questions that share tokens with different chunks
    prompts = [chunks[c, :4].tolist() + [5] for c in (0, 1, 2, 3)] + [chunks[1, 2:6].tolist()]
    first = [Question(prompts[0], memory, 3), Question(prompts[1], memory, MAX_TOKENS)]  # the first leaves early
    later = [Question(p, memory, MAX_TOKENS) for p in prompts[2:]]
    loop = DecodingLoop(model, [EOS], max_rows=8, lock=threading.Lock())
    priors, decode = [], loop._decode

    def noting_priors(rows):  # each step's rows and the priors they decode with, as the loop holds them
        priors.append(([q.ids for q in rows.questions], [kv.routing.prior for kv in rows.gca.layers.values()]))
        return decode(rows)

    loop._decode = noting_priors
    answer(loop, first, later, after=2)
    assert [q.tokens for q in first + later] == [alone(model, q) for q in first + later]
    own = {tuple(p): next(iter(model.with_question(memory.gca_memory, torch.tensor([p]),
                                                   torch.ones(1, len(p))).layers.values())).routing.prior
           for p in prompts}  # each question's prior (1, 1, C), computed alone
    assert len({prior.argmax().item() for prior in own.values()}) > 1  # the questions favour different chunks
    assert {len(ids) for ids, _ in priors} >= {2, 4, 5}  # rows joined, and left
    for ids, layers in priors:
        expected = torch.cat([own[tuple(p)] for p in ids], dim=1)
        assert all(torch.equal(prior, expected) for prior in layers)


@pytest.mark.parametrize("window", [1, 3])
def test_rows_reading_with_the_token_prior_answer_as_each_alone_as_rows_join_and_leave(checkpoint_root, window):
    """memory_lexical_tokens: each step's token prior is its rows' own tokens' (with memory_lexical_window, its own
    answer's last tokens'), whatever rows share the step."""
    model = reading(pair(checkpoint_root, "gca", reading=MemoryReading(top_k=1, lexical_routing=50.0,
                                                                       lexical_tokens=True, lexical_window=window)))
    memory = served(model, seed=4, chunks=4)
    chunks = memory.gca_memory.chunk_ids[0][0]
    prompts = [chunks[c, :4].tolist() + [5] for c in (0, 1, 2, 3)]
    first = [Question(prompts[0], memory, 3), Question(prompts[1], memory, MAX_TOKENS)]
    later = [Question(p, memory, MAX_TOKENS) for p in prompts[2:]]
    loop = DecodingLoop(model, [EOS], max_rows=8, lock=threading.Lock())
    answer(loop, first, later, after=2)
    assert [q.tokens for q in first + later] == [alone(model, q) for q in first + later]


def test_each_decoding_step_reads_the_largest_prior_of_its_answers_last_tokens(checkpoint_root, monkeypatch):
    """memory_lexical_reading_window 3 (the served model reads in eval mode), a sampled answer (its tokens vary) over
    a memory holding each token once: at each step the row's token prior is, on each chunk, the largest of its last
    three answer tokens' own priors (TokenIndex.prior of each, by hand), not its own token's alone."""
    model = reading(pair(checkpoint_root, "gca", reading=MemoryReading(top_k=1, lexical_routing=2.0,
                                                                       lexical_tokens=True, lexical_reading_window=3)))
    ids = torch.randperm(ENC_VOCAB, generator=torch.Generator().manual_seed(0)).view(1, 8, ENC_VOCAB // 8)
    memory = SimpleNamespace(gca_memory=model.prepare_memory(ids, torch.ones_like(ids)))  # each token in one chunk
    steps = []
    hold = GCAMemory.hold_tokens

    def recording(self, input_ids, weight, window=1, carry=1.0):
        hold(self, input_ids, weight, window, carry)
        routing = next(kv.routing for kv in self.layers.values() if kv.routing is not None)
        steps.append((input_ids.clone(), routing.token_prior.clone(), self.token_index, weight))

    monkeypatch.setattr(GCAMemory, "hold_tokens", recording)
    q = Question(memory.gca_memory.chunk_ids[0][0, 1, :4].tolist() + [5], memory, MAX_TOKENS, temperature=3.0, seed=2)
    answer(DecodingLoop(model, [], max_rows=4, lock=threading.Lock()), [q], [])
    assert len(set(q.tokens)) > 3 and len(steps) == MAX_TOKENS  # the prefill, then a step per token but the last
    for n, (fed, prior, index, weight) in enumerate(steps[1:], start=1):
        assert fed.tolist() == [[q.tokens[n - 1]]]
        window = q.tokens[max(0, n - 3):n]
        expected = torch.stack([index.prior(torch.tensor([[t]])) for t in window]).amax(0) * weight
        torch.testing.assert_close(prior, expected)
    assert not all(torch.equal(prior, index.prior(fed) * weight) for fed, prior, index, weight in steps[1:])


def test_a_seeded_sample_is_the_same_alone_and_in_a_batch_and_top_p_or_temperature_near_zero_is_greedy(
        checkpoint_root):
    model = reading(pair(checkpoint_root, "gca"))
    memory = served(model, seed=1)
    prompt = random_ids(1, 5, vocab=DEC_VOCAB, seed=3)[0].tolist()
    loop = DecodingLoop(model, [], max_rows=8, lock=threading.Lock())

    def sampled(**settings) -> Question:
        return Question(prompt, memory, MAX_TOKENS, temperature=1.5, **settings)

    by_itself = sampled(seed=11)
    answer(loop, [by_itself], [])
    batched = [sampled(seed=11), sampled(seed=12), sampled(), Question(prompt, memory, MAX_TOKENS)]
    narrow, tiny = sampled(top_p=1e-9), Question(prompt, memory, MAX_TOKENS, temperature=5e-324)
    answer(loop, batched[:2], batched[2:] + [narrow, tiny], after=1)
    assert batched[0].tokens == by_itself.tokens and batched[1].tokens != by_itself.tokens
    assert narrow.tokens == tiny.tokens == batched[3].tokens == alone(model, batched[3])  # 5e-324: greedy, no NaN


def test_a_cancelled_or_expired_row_stops_alone_and_a_failed_forward_fails_only_its_rows(checkpoint_root):
    model = reading(pair(checkpoint_root, "gca"))
    memory = served(model, seed=1)
    prompt = random_ids(1, 5, vocab=DEC_VOCAB, seed=3)[0].tolist()
    loop = DecodingLoop(model, [], max_rows=2, lock=threading.Lock())
    leaving, expiring = Question(prompt, memory, 400), Question(prompt, memory, 400, deadline=time.monotonic() + 0.3)
    staying = Question(prompt, memory, 12)  # waits for a free row: max_rows 2
    leaving.on_token = lambda _: len(leaving.tokens) == 4 and leaving.cancel()
    answer(loop, [leaving, expiring, staying], [])
    assert len(leaving.tokens) == 4 and not leaving.expired and leaving.error is None
    assert expiring.expired and 4 < len(expiring.tokens) < 400
    assert staying.tokens == alone(model, staying) and not staying.expired
    assert max(int(size) for size in loop.stats["sizes"]) == 2

    forward = model.decoder.forward
    calls = {"n": 0}

    def failing_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("a broken forward")
        return forward(*args, **kwargs)

    model.decoder.forward = failing_once
    try:
        broken, fine = Question(prompt, memory, 5), Question(prompt, None, 5)
        answer(loop, [broken], [])
        answer(loop, [fine], [])
    finally:
        del model.decoder.forward
    assert isinstance(broken.error, RuntimeError) and fine.error is None and fine.tokens == alone(model, fine)


def test_a_loop_without_room_for_a_row_is_refused(checkpoint_root):
    with pytest.raises(ValueError, match="max_batch_size 0"):
        DecodingLoop(pair(checkpoint_root, "gca"), [EOS], max_rows=0, lock=threading.Lock())
