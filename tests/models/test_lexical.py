"""Lexical routing (models/lexical.py): the question's idf prior on chunk scores against a hand-computed case, which
tokens count as the question, the chunks it makes a query read, that the routing loss ignores it, cached decoding,
generate and save/load with it, and the refusals."""

import math
from dataclasses import replace

import pytest
import torch

from models import AwarenessModel, MemoryReading, build_pair, gca_parameter_count
from models.gca import chunk_scores
from models.lexical import packed_question_prior, question_mask_of, question_prior
from pipelines.evaluate.probes import memory_attention
from tests.conftest import random_ids
from tests.models.test_awareness import cached_logits
from tests.models.test_fusion import DEC_VOCAB, logits, memory_batch
from tests.models.test_routing import routed_pair

ASKED = 100  # the question's rare token; the memories below are filler from FILLER
FILLER = (300, 496)


def idf(chunks: int, holding: int) -> float:
    return math.log(1 + (chunks - holding + 0.5) / (holding + 0.5))


def test_prior_is_the_summed_idf_of_the_distinct_question_tokens_each_chunk_holds():
    chunks = torch.tensor([[[5, 7, 1, 1], [7, 2, 2, 2], [3, 3, 3, 3], [5, 0, 0, 0]]])  # (1, C=4, L=4)
    chunk_mask = torch.ones_like(chunks, dtype=torch.bool)
    chunk_mask[0, 3] = False  # chunk 3 is padding: its 5 is not there, and it is not a chunk of the memory
    question = torch.tensor([[[5, 7, 7, 9, 2]]])  # (1, R=1, T=5): 7 twice, 9 nowhere in the memory
    asked = torch.tensor([[[True, True, True, True, False]]])  # the 2 is not part of the question (an answer token)
    prior = question_prior(question, asked, chunks, chunk_mask)
    five, seven = idf(3, 1), idf(3, 2)  # 3 real chunks: 5 is in one, 7 in two
    torch.testing.assert_close(prior, torch.tensor([[[five + seven, seven, 0.0, 0.0]]]))


def test_the_question_is_the_tokens_before_the_first_label_or_the_whole_prompt():
    ids = torch.tensor([[1, 100, 11, 12, 2], [1, 100, 101, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    labels = torch.tensor([[-100, -100, 11, 12, 2], [-100, -100, -100, -100, -100]])
    assert question_mask_of(ids, attention, labels).tolist() == [[True, True, False, False, False],
                                                               [True, True, True, False, False]]
    assert question_mask_of(ids, None, None).all()


def needle_memory(seed: int, where: list[int], chunks: int = 4, length: int = 8) -> torch.Tensor:
    """Filler chunks (B, C, L) with ASKED placed once, in chunk where[b] of row b."""
    g = torch.Generator().manual_seed(seed)
    memory = torch.randint(*FILLER, (len(where), chunks, length), generator=g)
    for row, chunk in enumerate(where):
        memory[row, chunk, 3] = ASKED
    return memory


@pytest.mark.parametrize("weights", ["attention", "router"])
def test_a_query_reads_the_chunk_holding_the_questions_rare_token(checkpoint_root, weights):
    """k = 1 and a heavy prior: every GCA layer's attention lies inside the chunk that names the question's token,
    wherever it is; without the prior the random routers read elsewhere for some rows."""
    _, routed = routed_pair(checkpoint_root, "gca", k=1, chunk_weights=weights, lexical_routing=100.0)
    where = [0, 1, 2, 3, 3, 1]
    mem = needle_memory(0, where)
    prompt = torch.cat([torch.ones(len(where), 1, dtype=torch.long), torch.full((len(where), 1), ASKED)], dim=1)
    for layer in memory_attention(routed, input_ids=prompt, memory_input_ids=mem):  # (B, H, M)
        mass = layer.view(len(where), layer.shape[1], 4, 8).sum(-1)  # (B, H, C)
        for row, chunk in enumerate(where):
            torch.testing.assert_close(mass[row, :, chunk], torch.ones(layer.shape[1]))
    routed.reading = replace(routed.reading, lexical_routing=0.0)
    elsewhere = [layer.view(len(where), layer.shape[1], 4, 8).sum(-1).argmax(-1)
                 for layer in memory_attention(routed, input_ids=prompt, memory_input_ids=mem)]
    assert any((chosen != torch.tensor(where)[:, None]).any() for chosen in elsewhere)


def test_chosen_chunks_are_the_top_scores_of_router_plus_prior_and_the_loss_ignores_the_prior(checkpoint_root):
    _, routed = routed_pair(checkpoint_root, "gca", k=2, lexical_routing=1.5)
    mem = needle_memory(1, [2, 0])
    prompt = torch.tensor([[1, ASKED, 7], [1, ASKED, 9]])
    unasked = routed.prepare_memory(mem)
    memory = routed.with_question(unasked, prompt, torch.ones_like(prompt, dtype=torch.bool))
    assert all(kv.routing.prior is None for kv in unasked.layers.values())  # the prepared memory is left as it was
    layer = next(iter(memory.layers.values()))
    query = torch.randn(2, 4, 3, 16, generator=torch.Generator().manual_seed(0))  # (B_mem, H, Q, hd) folded
    dense = chunk_scores(query, layer.routing, 0.25, with_prior=False)
    prior = question_prior(prompt[:, None], torch.ones(2, 1, 3, dtype=torch.bool), mem, torch.ones_like(mem).bool())
    torch.testing.assert_close(chunk_scores(query, layer.routing, 0.25), dense + 1.5 * prior[:, None])
    assert prior[0, 0, 2] > 0 and prior[0, 0, [0, 1, 3]].eq(0).all()  # the chunk naming ASKED, and no other
    # the routing loss trains the router's own scores: the same with and without the prior
    routed.train()
    ids = torch.tensor([[1, ASKED, 7, 8, 2], [1, ASKED, 9, 8, 2]])
    labels = ids.clone()
    labels[:, :2] = -100
    with_prior = routed(input_ids=ids, labels=labels, memory_input_ids=mem).routing_loss
    routed.reading = replace(routed.reading, lexical_routing=0.0)
    without = routed(input_ids=ids, labels=labels, memory_input_ids=mem).routing_loss
    torch.testing.assert_close(with_prior, without)


def test_cached_decoding_generate_and_save_load_with_lexical_routing(checkpoint_root, tmp_path):
    """The prior comes from the prompt: cached decoding equals a full forward whose labels mark the continuation
    as the answer; greedy generate is the argmax of such forwards; save and load keep the weight and the logits."""
    _, routed = routed_pair(checkpoint_root, "gca", k=1, chunk_weights="router", lexical_routing=2.0)
    mem, mask = memory_batch(chunks=4)
    prompt = torch.cat([random_ids(2, 4, vocab=DEC_VOCAB, seed=0), mem[:, 2, :2]], dim=1)  # names chunk 2's tokens
    continuation = mem[:, 0, :4]  # names chunk 0's: read as question, it would move the prior there
    ids = torch.cat([prompt, continuation], dim=1)
    labels = torch.cat([torch.full_like(prompt, -100), continuation], dim=1)
    full = logits(routed, ids, mem, mask, labels=labels)
    torch.testing.assert_close(cached_logits(routed, prompt, continuation, mem, mask), full, rtol=1e-4, atol=1e-5)
    # without labels the continuation counts as question: another prior, other chunks read, other logits
    assert not torch.allclose(logits(routed, ids, mem, mask), full, rtol=1e-4, atol=1e-5)
    assert_greedy_is_the_argmax_of_answered_forwards(routed, prompt, mem, mask)
    routed.save_pretrained(tmp_path / "run")
    loaded = AwarenessModel.from_pretrained(tmp_path / "run").eval()
    assert loaded.reading.lexical_routing == 2.0
    torch.testing.assert_close(logits(loaded, ids, mem, mask, labels=labels), full, rtol=1e-5, atol=1e-5)


def answered_rows(mem: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A prompt naming chunk 2's first tokens, an answer naming chunk 0's, both rows joined and the labels marking
    the answer: (prompt, continuation, ids, labels)."""
    prompt = torch.cat([random_ids(2, 4, vocab=DEC_VOCAB, seed=0), mem[:, 2, :2]], dim=1)
    continuation = mem[:, 0, :4]
    return (prompt, continuation, torch.cat([prompt, continuation], dim=1),
            torch.cat([torch.full_like(prompt, -100), continuation], dim=1))


def reloaded_reading_alike(model, directory, ids, mem, mask, labels, full) -> AwarenessModel:
    """The model saved and loaded back; its logits over the answered rows are `full`'s."""
    model.save_pretrained(directory)
    loaded = AwarenessModel.from_pretrained(directory).eval()
    torch.testing.assert_close(logits(loaded, ids, mem, mask, labels=labels), full, rtol=1e-5, atol=1e-5)
    return loaded


def train_on_the_answer(model, ids, mem, mask, labels) -> None:
    """One backward of the answer's loss, in training mode (the gradients are left on the parameters)."""
    model.train()
    model(input_ids=ids, labels=labels, memory_input_ids=mem, memory_attention_mask=mask).loss.backward()


def assert_greedy_is_the_argmax_of_answered_forwards(model, prompt, mem, mask, steps: int = 4) -> None:
    """Greedy generate equals, token by token, the argmax of full forwards whose labels mark what was generated as
    the answer (so the prompt alone is the question, as generate reads it)."""
    generated = model.generate(prompt, memory_input_ids=mem, memory_attention_mask=mask, max_new_tokens=steps,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = prompt
    for _ in range(steps):
        answer = torch.cat([torch.full_like(prompt, -100), ids[:, prompt.shape[1]:]], dim=1)
        step = logits(model, ids, mem, mask, labels=answer)
        ids = torch.cat([ids, step[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generated, ids)


def test_the_reading_weight_holds_in_eval_mode_only_and_is_saved(checkpoint_root, tmp_path):
    """memory_lexical_reading: the prior's weight when the model reads (eval mode); training keeps
    memory_lexical_routing's. Read, the model is the same one trained at the reading weight (logits equal); saved and
    loaded, it reads the same."""
    _, routed = routed_pair(checkpoint_root, "gca", k=2, chunk_weights="router", lexical_routing=1.5,
                            lexical_reading=6.0)  # the two chunks read are mixed by their scores, prior in
    mem, mask = memory_batch(chunks=4)
    prompt = torch.cat([random_ids(2, 3, vocab=DEC_VOCAB, seed=1), mem[:, 2, :2]], dim=1)
    question = torch.ones_like(prompt, dtype=torch.bool)
    unasked = routed.prepare_memory(mem, mask)
    prior = question_prior(prompt[:, None], question[:, None], mem, mask.bool())
    for training, weight in ((True, 1.5), (False, 6.0)):
        routed.train(training)
        layer = next(iter(routed.with_question(unasked, prompt, question).layers.values()))
        torch.testing.assert_close(layer.routing.prior, weight * prior)
    routed.eval()
    read = logits(routed, prompt, mem, mask)
    routed.reading = replace(routed.reading, lexical_routing=6.0, lexical_reading=None)  # trained at 6, read as trained
    torch.testing.assert_close(logits(routed, prompt, mem, mask), read)
    routed.reading = replace(routed.reading, lexical_routing=1.5)
    assert not torch.allclose(logits(routed, prompt, mem, mask), read)  # the weight it trained at reads otherwise
    routed.reading = replace(routed.reading, lexical_reading=6.0)
    routed.save_pretrained(tmp_path / "run")
    loaded = AwarenessModel.from_pretrained(tmp_path / "run").eval()
    assert (loaded.reading.lexical_routing, loaded.reading.lexical_reading) == (1.5, 6.0)
    torch.testing.assert_close(logits(loaded, prompt, mem, mask), read, rtol=1e-5, atol=1e-5)


def test_k_keeping_every_chunk_is_still_full_attention(checkpoint_root):
    full, routed = routed_pair(checkpoint_root, "gca", k=3, lexical_routing=5.0)
    ids = random_ids(2, 6, vocab=DEC_VOCAB, seed=3)
    mem, mask = memory_batch()
    torch.testing.assert_close(logits(routed, ids, mem, mask), logits(full, ids, mem, mask), rtol=1e-5, atol=1e-5)


def test_refusals(checkpoint_root):
    with pytest.raises(ValueError, match="memory_lexical_routing"):
        routed_pair(checkpoint_root, "gca", k=0, lexical_routing=1.0)
    with pytest.raises(ValueError, match="memory_lexical_routing"):
        routed_pair(checkpoint_root, "gca", k=1, lexical_routing=-1.0)
    with pytest.raises(ValueError, match="memory_lexical_reading .* with a positive memory_lexical_routing"):
        routed_pair(checkpoint_root, "gca", k=1, lexical_reading=10.0)
    with pytest.raises(ValueError, match="memory_lexical_reading"):
        routed_pair(checkpoint_root, "gca", k=1, lexical_routing=1.0, lexical_reading=-1.0)
    _, routed = routed_pair(checkpoint_root, "gca", k=1, lexical_routing=1.0)
    mem, mask = memory_batch()
    states, states_mask = routed.encode_memory(mem, mask)
    ids = random_ids(2, 5, vocab=DEC_VOCAB, seed=0)
    with pytest.raises(ValueError, match="came without them: pass memory_input_ids"):
        routed(input_ids=ids, memory_states=states.view(2, 3, 8, -1), memory_states_mask=states_mask.view(2, 3, 8))


def test_packed_examples_each_get_their_own_questions_prior(checkpoint_root):
    """Two examples in one row (question, then a labelled answer), each with its own chunks, one naming its own
    chunk 1's tokens: packed, each example's logits are its logits alone (its question, its chunks' idf)."""
    _, routed = routed_pair(checkpoint_root, "gca", k=1, chunk_weights="router", lexical_routing=3.0)
    mem_a, mem_b = random_ids(1, 3, 8, vocab=496, seed=8), random_ids(1, 3, 8, vocab=496, seed=9)
    mask_b = torch.ones_like(mem_b)
    mask_b[0, 2] = 0  # example b's last chunk is padding
    a = torch.cat([torch.tensor([[1]]), mem_a[:, 1, :3], mem_b[:, 0, :2]], dim=1)  # asks a's chunk 1 (and b's tokens)
    b = torch.cat([torch.tensor([[1]]), mem_b[:, 1, 2:5], mem_b[:, 1, 2:3]], dim=1)  # a repeated question token
    label_a, label_b = a.clone(), b.clone()
    label_a[:, :4], label_b[:, :3] = -100, -100  # a's answer: its last 2 tokens; b's: its last 2
    alone = [logits(routed, a, mem_a, torch.ones_like(mem_a), labels=label_a),
             logits(routed, b, mem_b, mask_b, labels=label_b)]
    inputs = dict(input_ids=torch.cat([a, b], dim=1), labels=torch.cat([label_a, label_b], dim=1),
                  position_ids=torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4]]),
                  segment_ids=torch.tensor([[0] * 6 + [1] * 5]), memory_input_ids=torch.cat([mem_a, mem_b], dim=1),
                  memory_attention_mask=torch.cat([torch.ones_like(mem_a), mask_b], dim=1),
                  memory_segment_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]))
    with torch.no_grad():
        packed = routed(**inputs).logits
    torch.testing.assert_close(packed[:, :6], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 6:], alone[1], rtol=1e-5, atol=1e-5)
    routed.reading = replace(routed.reading, lexical_routing=0.0)  # and the prior mattered
    assert (logits(routed, a, mem_a, torch.ones_like(mem_a), labels=label_a) - alone[0]).abs().max() > 1e-4


def test_packed_prior_equals_the_per_row_prior():
    """packed_question_prior of one example a row is question_prior's."""
    chunks = torch.randint(0, 50, (2, 4, 6), generator=torch.Generator().manual_seed(0))
    chunk_mask = torch.ones_like(chunks, dtype=torch.bool)
    chunk_mask[1, 3] = False
    ids = torch.cat([chunks[:, 2, :3], chunks[:, 0, :1], torch.randint(0, 50, (2, 3))], dim=1)  # (2, 7)
    labels = torch.full_like(ids, -100)
    labels[:, 5:] = ids[:, 5:]
    packed = packed_question_prior(ids, torch.zeros_like(ids), labels, chunks, chunk_mask, torch.zeros(2, 4).long())
    per_row = question_prior(ids[:, None], question_mask_of(ids, None, labels)[:, None], chunks, chunk_mask)  # (2,1,C)
    torch.testing.assert_close(packed, per_row.expand(2, 7, 4))


def test_one_prepared_memory_serves_each_question_with_its_own_prior(checkpoint_root):
    """As the Serve app does: one memory prepared once, then questions naming different chunks, each generated over
    it, answer as with the memory encoded for that question alone; the prepared memory keeps no question."""
    _, routed = routed_pair(checkpoint_root, "gca", k=1, chunk_weights="router", lexical_routing=3.0)
    mem = needle_memory(2, [1], chunks=4)
    mem[0, 3, 5] = ASKED + 1  # a second rare token, in chunk 3
    prepared = routed.prepare_memory(mem)
    kwargs = dict(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    answers = []
    for asked in (ASKED, ASKED + 1):
        prompt = torch.tensor([[1, asked]])
        shared = routed.generate(prompt, gca_memory=prepared, **kwargs)
        assert torch.equal(shared, routed.generate(prompt, memory_input_ids=mem, **kwargs))
        answers.append(shared)
    assert all(kv.routing.prior is None for kv in prepared.layers.values())
    two = routed.with_question(prepared, torch.tensor([[1, ASKED], [1, ASKED + 1]]), torch.ones(2, 2, dtype=torch.bool))
    priors = next(iter(two.layers.values())).routing.prior  # (1, 2, C): each row its own
    assert priors[0, 0].argmax() == 1 and priors[0, 1].argmax() == 3


def gated(checkpoint_root, k: int = 1, **reading):
    """The routed pair with lexical gates (memory_lexical_gate), the gates as built (passing the whole prior)."""
    _, routed = routed_pair(checkpoint_root, "gca", k=k, chunk_weights="router", lexical_routing=2.0,
                            lexical_gate=True, **reading)
    return routed


def gates(model):
    return [block.lexical_gate for block in model.memory_readers().values()]


def test_the_lexical_gate_passes_the_whole_prior_until_trained_and_can_turn_it_off(checkpoint_root):
    """Built, every gate is 2 sigmoid(0) = 1: the model reads as one without gates. A gate shut (bias -30) reads as
    a model without the prior; one wide open (+30) as one with twice the weight."""
    routed = gated(checkpoint_root)
    mem, mask = memory_batch(chunks=4)
    prompt = torch.cat([random_ids(2, 4, vocab=DEC_VOCAB, seed=0), mem[:, 2, :2]], dim=1)
    reference = logits(routed, prompt, mem, mask)
    built = gates(routed)
    assert all(g.weight.eq(0).all() and g.bias.eq(0).all() for g in built)
    for block in routed.memory_readers().values():
        block.lexical_gate = None
    torch.testing.assert_close(logits(routed, prompt, mem, mask), reference, rtol=0, atol=0)
    for block, gate in zip(routed.memory_readers().values(), built, strict=True):
        block.lexical_gate = gate
    for bias, weight in ((-30.0, 0.0), (30.0, 4.0)):
        with torch.no_grad():
            for gate in built:
                gate.bias.fill_(bias)
        expected_model = gated(checkpoint_root)
        expected_model.load_state_dict(routed.state_dict())
        for block in expected_model.memory_readers().values():
            block.lexical_gate = None
        expected_model.reading = replace(expected_model.reading, lexical_routing=weight, lexical_gate=False)
        torch.testing.assert_close(logits(routed, prompt, mem, mask), logits(expected_model, prompt, mem, mask),
                                   rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits(routed, prompt, mem, mask), reference)


def test_the_lexical_gate_learns_decodes_as_a_full_forward_and_is_saved(checkpoint_root, tmp_path):
    """k = 2: the router-weighted read mixes two chunks by their scores, prior included, so the answer's loss reaches
    the gates (with k = 1 the one chunk weighs 1 whatever its score)."""
    routed = gated(checkpoint_root, k=2)
    with torch.no_grad():
        for n, gate in enumerate(gates(routed)):
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=torch.Generator().manual_seed(n)))
    mem, mask = memory_batch(chunks=4)
    prompt, continuation, ids, labels = answered_rows(mem)
    full = logits(routed, ids, mem, mask, labels=labels)
    torch.testing.assert_close(cached_logits(routed, prompt, continuation, mem, mask), full, rtol=1e-4, atol=1e-5)
    assert reloaded_reading_alike(routed, tmp_path / "run", ids, mem, mask, labels, full).reading.lexical_gate
    train_on_the_answer(routed, ids, mem, mask, labels)
    assert all(g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in gates(routed))


def test_the_lexical_gate_needs_a_prior_and_the_gca_fusion_and_is_counted():
    with pytest.raises(ValueError, match="lexical_gate"):
        MemoryReading(top_k=2, lexical_gate=True).check("gca")
    with pytest.raises(ValueError, match="lexical_gate"):
        MemoryReading(top_k=2, lexical_routing=1.0, lexical_gate=True).check("cross")
    plain = build_pair("tiny", device="meta", reading=MemoryReading(top_k=2, lexical_routing=1.0))
    with pytest.raises(ValueError, match="built without lexical gates"):
        plain.reading = replace(plain.reading, lexical_gate=True)
    added = {}
    for gate in (False, True):
        model = build_pair("tiny", device="meta", reading=MemoryReading(top_k=2, lexical_routing=1.0,
                                                                        lexical_gate=gate))
        added[gate] = sum(p.numel() for n, p in model.named_parameters() if ".cross_attention." in n)
    d = model.decoder.config
    shape = dict(hidden_size=d.hidden_size, num_heads=d.num_attention_heads, num_kv_heads=d.num_key_value_heads,
                 head_dim=d.head_dim, num_gca_layers=len(model.gca_layers), encoder_hidden_size=d.hidden_size,
                 router=True)
    assert added[True] - added[False] == len(model.gca_layers) * (d.hidden_size + 1)
    assert added[True] - added[False] == (gca_parameter_count(**shape, lexical_gate=True)
                                          - gca_parameter_count(**shape))
