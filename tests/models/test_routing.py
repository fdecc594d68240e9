"""Chunk-routed memory attention and the length-aware scale (models/gca.py): the routed attention against a written-out
reference, exact parity with full attention when k keeps every chunk, padding, packed rows, folded rows, cached and
generated decoding, the routing loss and its gradients, probes, save/load and the refusals."""

import math
from dataclasses import replace

import pytest
import torch

from models import (AwarenessModel, LoraPlan, LoraSettings, MemoryReading, apply_lora, build_pair, gca_parameter_count,
                    set_trainable)
from models.gca import ChunkRouting, MemoryKV, MemoryPadding, attend_memory, memory_probabilities
from models.gca import _routing_loss as routing_loss
import models.gca as gca
from pipelines.evaluate.probes import chunk_reading, memory_attention
from tests.conftest import random_ids
from tests.models.test_awareness import cached_logits
from tests.models.test_fusion import DEC_VOCAB, ENC_VOCAB, logits, memory_batch, pair, reading

FUSIONS = ("gca", "cross")


def routed_pair(checkpoint_root, fusion: str, k: int, **kwargs) -> tuple[AwarenessModel, AwarenessModel]:
    """The same reading model twice: without routers, and with them (random) and memory_top_k = k."""
    full = reading(pair(checkpoint_root, fusion))
    routed = pair(checkpoint_root, fusion, reading=MemoryReading(top_k=k, **kwargs))
    missing = routed.load_state_dict(full.state_dict(), strict=False).missing_keys
    assert missing and all(".router." in name or ".lexical_gate." in name for name in missing)
    return full, routed


def paths(model: AwarenessModel, mem, mask, path: str):
    """The model's memory with every layer's routing forced onto one path (masked or gathered)."""
    memory = model.prepare_memory(mem, mask)
    for kv in memory.layers.values():
        kv.routing.path = path
    return memory


# ------------------------------------------------------------------------------------------ the attention alone
NH, NKV, HD, C, L = 4, 2, 8, 5, 3


def routed_memory(k: int, seed: int = 0, b_mem: int = 2, logn: int = 0, path: str = "auto"):
    g = torch.Generator().manual_seed(seed)
    key, value = torch.randn(b_mem, NKV, C * L, HD, generator=g), torch.randn(b_mem, NKV, C * L, HD, generator=g)
    summary = torch.randn(b_mem, NKV, C, HD, generator=g)
    mask = torch.ones(b_mem, C * L, dtype=torch.bool)
    mask[1, 4 * L:] = False  # row 1's last chunk is all padding...
    mask[1, 2 * L + 1:3 * L] = False  # ...and its chunk 2 holds one real token
    summary[1, :, 4] = 50.0  # the padding chunk would win every query: it must never be selected
    padding = MemoryPadding.from_mask(mask)
    chunks = mask.view(b_mem, C, L).any(-1)[:, None, None, :]
    routing = ChunkRouting(summary=summary, chunk_len=L, top_k=k, chunk_mask=chunks, path=path)
    return MemoryKV(key, value, padding, routing=routing, logn_base=logn), mask


def reference_routed(query, memory: MemoryKV, mask, k: int, logn: int = 0):
    """Written out per row, query and kv head: the k chunks of highest (mean query head) . summary among the readable
    ones, then a softmax over their real tokens; logn scales by max(1, log n / log n_train), n the tokens read."""
    b, t, h, hd = query.shape
    r, group = b // memory.key.shape[0], h // NKV
    out, chosen_sets = torch.zeros(b, t, h, hd), {}
    for row in range(b):
        m = row // r
        for i in range(t):
            for g in range(NKV):
                heads = query[row, i, g * group:(g + 1) * group]  # (G, hd)
                scores = [float(heads.mean(0) @ memory.routing.summary[m, g, c]) / math.sqrt(hd)
                          if mask[m, c * L:(c + 1) * L].any() else -math.inf for c in range(C)]
                chosen = sorted(range(C), key=lambda c: -scores[c])[:k]
                chosen_sets[row, i, g] = set(chosen)
                tokens = [p for c in chosen for p in range(c * L, (c + 1) * L) if mask[m, p]]
                factor = max(1.0, math.log(len(tokens)) / math.log(logn)) if logn else 1.0
                keys, values = memory.key[m, g, tokens], memory.value[m, g, tokens]
                for j, head in enumerate(heads):
                    weights = ((head * factor) @ keys.T / math.sqrt(hd)).softmax(-1)
                    out[row, i, g * group + j] = weights @ values
    return out.reshape(b, t, h * hd), chosen_sets


@pytest.mark.parametrize("path", ["masked", "gathered"])
@pytest.mark.parametrize("logn", [0, 4])
def test_routed_attention_reads_the_top_scoring_chunks_only(path, logn):
    """Rows fold (4 query rows over 2 memories); the padding chunk, whose summary would score highest, is never kept;
    both paths equal the written-out reference, with and without the length-aware scale."""
    memory, mask = routed_memory(k=2, logn=logn, path=path)
    query = torch.randn(4, 3, NH, HD, generator=torch.Generator().manual_seed(1))
    out, folded = attend_memory(query, memory)
    expected, chosen = reference_routed(query, memory, mask, k=2, logn=logn)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert all(4 not in chunks for (row, _, _), chunks in chosen.items() if row >= 2)
    # the probe: the attention over every memory token, zero outside the chosen chunks, summing to one
    probs = memory_probabilities(folded, memory, scale=HD**-0.5)  # (B_mem, H, r*T, M)
    assert probs.shape == (2, NH, 6, C * L)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, NH, 6))
    read = probs.view(2, NH, 6, C, L).sum(-1) > 0  # (B_mem, H, r*T, C)
    for (row, i, g), chunks in chosen.items():
        for head in range(g * NH // NKV, (g + 1) * NH // NKV):
            got = read[row // 2, head, (row % 2) * 3 + i].nonzero().flatten().tolist()
            assert set(got) == chunks & {c for c in range(C) if mask[row // 2, c * L:(c + 1) * L].any()}
    values = memory.value.repeat_interleave(NH // NKV, dim=1)  # the probe is the attention that was applied
    applied = (probs @ values).view(2, NH, 2, 3, HD).permute(0, 2, 3, 1, 4).reshape(4, 3, NH * HD)
    torch.testing.assert_close(applied, out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["masked", "gathered"])
def test_several_summaries_a_chunk_score_it_by_its_best_readable_block(path):
    """S summary keys a chunk (one per block of L / S tokens): a chunk scores the best of its readable blocks, a
    padding block never counts (its summary would win every query), and the tokens read are exactly those chunks'."""
    memory, mask = routed_memory(k=2, path=path)
    summaries = L  # blocks of one token
    summary = torch.randn(2, NKV, C * summaries, HD, generator=torch.Generator().manual_seed(5))
    summary[1, :, 2 * summaries + 1] = 50.0  # row 1's chunk 2: one real token, then padding
    blocks = mask.view(2, C * summaries, L // summaries).any(-1)[:, None, None, :]
    memory.routing = ChunkRouting(summary=summary, chunk_len=L, top_k=2, chunk_mask=memory.routing.chunk_mask,
                                  path=path, summaries=summaries, summary_mask=blocks)
    query = torch.randn(4, 3, NH, HD, generator=torch.Generator().manual_seed(1))
    out, folded = attend_memory(query, memory)
    probs = memory_probabilities(folded, memory, scale=HD**-0.5)  # (B_mem, H, r*T, M)
    read = probs.view(2, NH, 6, C, L).sum(-1) > 0
    group = NH // NKV
    for row in range(4):
        m = row // 2
        for i in range(3):
            for g in range(NKV):
                heads = query[row, i, g * group:(g + 1) * group].mean(0)
                scores = [max(float(heads @ summary[m, g, c * summaries + b]) for b in range(summaries)
                              if mask[m, c * L + b]) if mask[m, c * L:(c + 1) * L].any() else -math.inf
                          for c in range(C)]
                chosen = set(sorted(range(C), key=lambda c: -scores[c])[:2])
                for head in range(g * group, (g + 1) * group):
                    got = set(read[m, head, (row % 2) * 3 + i].nonzero().flatten().tolist())
                    assert got == chosen & {c for c in range(C) if mask[m, c * L:(c + 1) * L].any()}
    values = memory.value.repeat_interleave(group, dim=1)  # and what was read is what the output holds
    applied = (probs @ values).view(2, NH, 2, 3, HD).permute(0, 2, 3, 1, 4).reshape(4, 3, NH * HD)
    torch.testing.assert_close(applied, out, rtol=1e-5, atol=1e-5)


def reference_router_weighted(query, memory: MemoryKV, mask, k: int):
    """Grouped Cross Attention's read, written out: per row, query and kv head, the k chunks of highest score among
    the readable ones; a softmax over each chosen chunk's real tokens; the chunk outputs mixed by the softmax of
    their scores."""
    b, t, h, hd = query.shape
    r, group = b // memory.key.shape[0], h // NKV
    summary = memory.routing.summary.detach()
    out = torch.zeros(b, t, h, hd)
    for row in range(b):
        m = row // r
        for i in range(t):
            for g in range(NKV):
                heads = query[row, i, g * group:(g + 1) * group]
                scores = torch.tensor([float(heads.mean(0) @ summary[m, g, c]) / math.sqrt(hd)
                                       if mask[m, c * L:(c + 1) * L].any() else -math.inf for c in range(C)])
                chosen = scores.argsort(descending=True)[:k].tolist()
                mix = scores[chosen].softmax(-1)
                for j, head in enumerate(heads):
                    for weight, c in zip(mix.tolist(), chosen, strict=True):
                        tokens = [p for p in range(c * L, (c + 1) * L) if mask[m, p]]
                        if not tokens:
                            continue
                        keys, values = memory.key[m, g, tokens], memory.value[m, g, tokens]
                        out[row, i, g * group + j] += weight * (head @ keys.T / math.sqrt(hd)).softmax(-1) @ values
    return out.reshape(b, t, h * hd)


@pytest.mark.parametrize("k", [2, 4])
def test_router_weighted_read_is_grouped_cross_attention(k):
    """memory_chunk_weights='router': a softmax inside each chosen chunk, the chunk outputs mixed by the softmax of
    their scores (k = 4 on row 1 also chooses an all-padding chunk: it weighs nothing). Against the written-out
    reference; the probe holds the weights that were applied; the answer's gradient reaches the summary keys and
    the queries (with one softmax over the chosen tokens it reaches neither: selection is not differentiable)."""
    memory, mask = routed_memory(k=k)
    memory.routing.weights = "router"
    memory.routing.summary.requires_grad_()
    query = torch.randn(4, 3, NH, HD, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out, folded = attend_memory(query, memory)
    torch.testing.assert_close(out, reference_router_weighted(query.detach(), memory, mask, k), rtol=1e-5, atol=1e-5)
    probs = memory_probabilities(folded, memory, scale=HD**-0.5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, NH, 6))
    values = memory.value.repeat_interleave(NH // NKV, dim=1)
    applied = (probs @ values).view(2, NH, 2, 3, HD).permute(0, 2, 3, 1, 4).reshape(4, 3, NH * HD)
    torch.testing.assert_close(applied, out, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    assert memory.routing.summary.grad.abs().sum() > 0 and query.grad.abs().sum() > 0
    memory.routing.weights, memory.routing.summary.grad = "attention", None
    attend_memory(query, memory)[0].square().sum().backward()
    assert memory.routing.summary.grad is None


def test_k_keeping_every_chunk_is_full_attention_exactly():
    memory, _ = routed_memory(k=C)
    query = torch.randn(4, 3, NH, HD, generator=torch.Generator().manual_seed(1))
    full = MemoryKV(memory.key, memory.value, memory.padding)
    assert torch.equal(attend_memory(query, memory)[0], attend_memory(query, full)[0])


def test_routing_loss_is_the_kl_from_full_attentions_chunk_mass():
    memory, mask = routed_memory(k=2)
    query = torch.randn(2, 3, NH, HD, generator=torch.Generator().manual_seed(2))
    summary = memory.routing.summary.clone()
    memory.routing.summary.requires_grad_(True)
    folded = query.transpose(1, 2)  # (B_mem, H, T, hd): one query row per memory
    loss = routing_loss(folded, memory, HD**-0.5)
    total, count = 0.0, 0
    for m in range(2):
        readable = [c for c in range(C) if mask[m, c * L:(c + 1) * L].any()]
        for i in range(3):
            for g in range(NKV):
                heads = query[m, i, g * NH // NKV:(g + 1) * NH // NKV]
                teacher = torch.zeros(C)
                for head in heads:
                    token_logits = [[head @ memory.key[m, g, p] / math.sqrt(HD) for p in range(c * L, (c + 1) * L)
                                     if mask[m, p]] for c in readable]
                    lse = torch.stack([torch.logsumexp(torch.stack(chunk), 0) for chunk in token_logits])
                    teacher[readable] += lse.softmax(-1) / len(heads)
                scores = torch.tensor([float(heads.mean(0) @ summary[m, g, c]) / math.sqrt(HD) for c in readable])
                total += float((teacher[readable] * (teacher[readable].log() - scores.log_softmax(-1))).sum())
                count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-4)
    loss.backward()
    assert memory.routing.summary.grad.abs().sum() > 0


# ----------------------------------------------------------------------------------------------- the whole model
@pytest.mark.parametrize("fusion", FUSIONS)
def test_k_at_least_the_chunks_equals_full_attention_and_fewer_changes_it(checkpoint_root, fusion):
    full, routed = routed_pair(checkpoint_root, fusion, k=3)
    ids = random_ids(2, 9, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch()
    mask[1, 2, 4:] = 0
    expected = logits(full, ids, mem, mask)
    torch.testing.assert_close(logits(routed, ids, mem, mask), expected, rtol=1e-5, atol=1e-5)
    routed.reading = replace(routed.reading, top_k=1)
    assert (logits(routed, ids, mem, mask) - expected).abs().max() > 1e-3


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("path", ["masked", "gathered"])
def test_keeping_every_real_chunk_is_full_attention_on_both_paths(checkpoint_root, fusion, path):
    """k = 2 of 4 chunks, but each row has at most 2 with real tokens: the routed path runs and reads all of them."""
    full, routed = routed_pair(checkpoint_root, fusion, k=2)
    ids = random_ids(2, 7, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch(chunks=4)
    mask[0, 1], mask[0, 3], mask[1, 0], mask[1, 2, 5:], mask[1, 3] = 0, 0, 0, 0, 0
    expected = logits(full, ids, mem, mask)
    routed_logits = routed(input_ids=ids, gca_memory=paths(routed, mem, mask, path)).logits
    torch.testing.assert_close(routed_logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_masked_and_gathered_paths_agree(checkpoint_root, fusion):
    _, routed = routed_pair(checkpoint_root, fusion, k=1)
    ids = random_ids(2, 6, vocab=DEC_VOCAB, seed=1)
    mem, mask = memory_batch(chunks=4)
    mask[1, 3] = 0
    with torch.no_grad():
        masked, gathered = (routed(input_ids=ids, gca_memory=paths(routed, mem, mask, p)).logits
                            for p in ("masked", "gathered"))
    torch.testing.assert_close(masked, gathered, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_cached_decoding_with_routing_equals_a_full_forward_with_routing(checkpoint_root, fusion):
    _, routed = routed_pair(checkpoint_root, fusion, k=1)
    prompt, continuation = random_ids(2, 6, vocab=DEC_VOCAB, seed=0), random_ids(2, 5, vocab=DEC_VOCAB, seed=1)
    mem, mask = memory_batch()
    mask[1, 2, 3:] = 0
    full = logits(routed, torch.cat([prompt, continuation], dim=1), mem, mask)
    torch.testing.assert_close(cached_logits(routed, prompt, continuation, mem, mask), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_generate_with_routing_greedy_and_beams(checkpoint_root, fusion):
    """Greedy generate is the argmax of routed full forwards; beams (folded rows) give each row its answer alone;
    with k keeping every chunk, generation is full attention's."""
    full, routed = routed_pair(checkpoint_root, fusion, k=1)
    prompt = random_ids(2, 5, vocab=DEC_VOCAB, seed=4)
    mem, mask = memory_batch(seed=5)
    mask[1, 2:] = 0
    kwargs = dict(max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    greedy = routed.generate(prompt, memory_input_ids=mem, memory_attention_mask=mask, do_sample=False, **kwargs)
    ids = prompt
    for _ in range(5):
        ids = torch.cat([ids, logits(routed, ids, mem, mask)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(greedy, ids)
    together = routed.generate(prompt, memory_input_ids=mem, memory_attention_mask=mask, num_beams=3, **kwargs)
    for row, chunks in ((0, 3), (1, 2)):
        alone = routed.generate(prompt[row:row + 1], memory_input_ids=mem[row:row + 1, :chunks],
                                memory_attention_mask=mask[row:row + 1, :chunks], num_beams=3, **kwargs)
        assert torch.equal(together[row:row + 1], alone)
    routed.reading = replace(routed.reading, top_k=3)
    for mode in (dict(do_sample=False), dict(num_beams=3)):
        expected = full.generate(prompt, memory_input_ids=mem, memory_attention_mask=mask, **mode, **kwargs)
        assert torch.equal(routed.generate(prompt, memory_input_ids=mem, memory_attention_mask=mask, **mode, **kwargs),
                           expected)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_router_weights_learn_from_the_answer_and_survive_decoding_and_save(checkpoint_root, fusion, tmp_path):
    """With memory_chunk_weights='router' and no routing loss the language-model loss alone trains the routers (k
    = 2 of 4 chunks: with k = 1 the mix is always 1); cached decoding equals a full forward; save and load keep the
    mode and the logits."""
    _, routed = routed_pair(checkpoint_root, fusion, k=2, chunk_weights="router", routing_loss=0.0)
    ids = random_ids(2, 8, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch(chunks=4)
    mask[1, 3] = 0
    routed.train()
    out = routed(input_ids=ids, labels=ids, memory_input_ids=mem, memory_attention_mask=mask)
    assert out.routing_loss is None
    out.loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in routed.named_parameters() if ".router." in n)
    routed.eval()
    prompt, continuation = ids[:, :5], ids[:, 5:]
    full = logits(routed, ids, mem, mask)
    torch.testing.assert_close(cached_logits(routed, prompt, continuation, mem, mask), full, rtol=1e-4, atol=1e-5)
    routed.save_pretrained(tmp_path / "run")
    loaded = AwarenessModel.from_pretrained(tmp_path / "run").eval()
    assert loaded.reading.chunk_weights == "router"
    torch.testing.assert_close(logits(loaded, ids, mem, mask), full, rtol=1e-5, atol=1e-5)


def test_rows_sharing_a_memory_read_it_as_copies_would(checkpoint_root):
    _, routed = routed_pair(checkpoint_root, "gca", k=1)
    ids = random_ids(4, 6, vocab=DEC_VOCAB, seed=2)
    mem, mask = memory_batch()
    mask[1, 1] = 0
    folded = routed(input_ids=ids, gca_memory=routed.prepare_memory(mem, mask)).logits  # rows 0,1 -> 0; 2,3 -> 1
    copied = logits(routed, ids, mem.repeat_interleave(2, dim=0), mask.repeat_interleave(2, dim=0))
    torch.testing.assert_close(folded, copied, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_packed_examples_route_within_their_own_chunks(checkpoint_root, fusion):
    """Two examples packed in one row, each with its own chunks: with k = 1 each token keeps one of its own
    example's chunks, so the packed logits are each example's alone."""
    _, routed = routed_pair(checkpoint_root, fusion, k=1)
    a, b = random_ids(1, 5, vocab=DEC_VOCAB, seed=6), random_ids(1, 4, vocab=DEC_VOCAB, seed=7)
    mem_a, mem_b = random_ids(1, 2, 8, vocab=ENC_VOCAB, seed=8), random_ids(1, 3, 8, vocab=ENC_VOCAB, seed=9)
    mask_b = torch.ones_like(mem_b)
    mask_b[0, 2] = 0  # example b's last chunk is padding
    alone = [logits(routed, a, mem_a, torch.ones_like(mem_a)), logits(routed, b, mem_b, mask_b)]
    inputs = dict(input_ids=torch.cat([a, b], dim=1), position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]]),
                  segment_ids=torch.tensor([[0] * 5 + [1] * 4]), memory_input_ids=torch.cat([mem_a, mem_b], dim=1),
                  memory_attention_mask=torch.cat([torch.ones_like(mem_a), mask_b], dim=1),
                  memory_segment_ids=torch.tensor([[0, 0, 1, 1, 1]]))
    with torch.no_grad():
        packed = routed(**inputs).logits
    torch.testing.assert_close(packed[:, :5], alone[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 5:], alone[1], rtol=1e-5, atol=1e-5)
    # and the routing mattered: keeping both of a's chunks reads otherwise
    routed.reading = replace(routed.reading, top_k=2)
    assert (logits(routed, a, mem_a, torch.ones_like(mem_a)) - alone[0]).abs().max() > 1e-4


@pytest.mark.parametrize("fusion", FUSIONS)
def test_routing_loss_trains_the_routers_only_and_they_learn(checkpoint_root, fusion):
    _, routed = routed_pair(checkpoint_root, fusion, k=1)
    routed.train()
    ids = random_ids(2, 8, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch(chunks=4)
    mask[1, 3] = 0
    out = routed(input_ids=ids, labels=ids, memory_input_ids=mem, memory_attention_mask=mask)
    lm = routed.decoder(input_ids=ids, labels=ids, gca_memory=routed.prepare_memory(mem, mask)).loss
    assert out.routing_loss > 0
    torch.testing.assert_close(out.loss, lm + out.routing_loss)
    routed.zero_grad()
    out.routing_loss.backward()
    grads = {n: p.grad for n, p in routed.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all(".router." in n for n in grads)  # nothing else moves for it
    routed.zero_grad()
    lm.backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for n, p in routed.named_parameters() if ".router." in n)
    routers = [p for n, p in routed.named_parameters() if ".router." in n]
    optimizer = torch.optim.Adam(routers, lr=3e-2)
    first = None
    for _ in range(40):
        optimizer.zero_grad()
        loss = routed(input_ids=ids, memory_input_ids=mem, memory_attention_mask=mask).routing_loss
        first = first if first is not None else loss.item()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5 * first
    routed.eval()
    assert routed(input_ids=ids, memory_input_ids=mem, memory_attention_mask=mask).routing_loss is None


@pytest.mark.parametrize("fusion", FUSIONS)
def test_routing_loss_can_train_the_summaries_the_encoder_makes(checkpoint_root, fusion):
    """routing_trains_summaries: the routing loss also reaches the encoder (what the chunk summaries are made of), never
    the decoder or the memory readers' own projections; the forward and its losses are unchanged."""
    _, routed = routed_pair(checkpoint_root, fusion, k=1)
    routed.train()
    routed.memory_encoder.requires_grad_(True)  # an encoder that trains (stage 0's)
    ids = random_ids(2, 8, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch(chunks=4)
    before = routed(input_ids=ids, labels=ids, memory_input_ids=mem, memory_attention_mask=mask)
    routed.routing_trains_summaries = True
    out = routed(input_ids=ids, labels=ids, memory_input_ids=mem, memory_attention_mask=mask)
    torch.testing.assert_close(out.loss, before.loss)  # training returns no logits: the loss reads them all
    torch.testing.assert_close(out.routing_loss, before.routing_loss)
    routed.zero_grad()
    out.routing_loss.backward()
    moved = {n for n, p in routed.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any(".router." in n for n in moved) and any(n.startswith("memory_encoder.") for n in moved)
    assert all(".router." in n or n.startswith(("memory_encoder.", "memory_projection.")) for n in moved), moved


def test_routing_loss_under_gradient_checkpointing_and_lora(checkpoint_root):
    def grads(checkpointing):
        _, routed = routed_pair(checkpoint_root, "gca", k=1)
        apply_lora(routed, LoraPlan(gca=LoraSettings(rank=2)))
        set_trainable(routed, gca="lora")  # routers train in full beside the adapters, as gates do
        routed.train()
        if checkpointing:
            routed.gradient_checkpointing_enable()
        ids = random_ids(2, 8, vocab=DEC_VOCAB, seed=0)
        mem, mask = memory_batch(chunks=4)
        routed(input_ids=ids, labels=ids, memory_input_ids=mem, memory_attention_mask=mask).loss.backward()
        return {n: p.grad.clone() for n, p in routed.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert any(".router." in n and g.abs().sum() > 0 for n, g in plain.items())
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-4, atol=1e-6)


def test_memory_attention_probe_under_routing(checkpoint_root):
    """Evaluation's probe: per layer the attention over every memory token, the unselected chunks at 0."""
    _, routed = routed_pair(checkpoint_root, "gca", k=1)
    ids = random_ids(2, 6, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch()
    probes = memory_attention(routed, input_ids=ids, memory_input_ids=mem, memory_attention_mask=mask)
    for attention in probes:  # (B, H, M)
        torch.testing.assert_close(attention.sum(-1), torch.ones(2, attention.shape[1]))
        per_chunk = attention.view(2, attention.shape[1], 3, 8).sum(-1)
        assert ((per_chunk > 0).sum(-1) == 1).all()  # one chunk per kv head's query heads


def test_chunk_reading_probe_gives_the_chunks_read_and_full_attentions_chunk_mass(checkpoint_root):
    """Where routing sends a query and where full attention would: the top-k of the probe's scores are the chunks
    the routed read attends (k=1), and its mass is full attention's, summed per chunk and averaged over a kv head's
    query heads (k = every chunk, where the read is full attention in every layer)."""
    ids = random_ids(2, 6, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch()  # 3 chunks of 8
    mask[1, 2] = 0  # row 1's last chunk is padding: never chosen, no mass
    inputs = {"input_ids": ids, "memory_input_ids": mem, "memory_attention_mask": mask}
    for k in (1, 3):
        _, routed = routed_pair(checkpoint_root, "gca", k=k)
        reads, attention = chunk_reading(routed, **inputs), memory_attention(routed, **inputs)
        assert len(reads) == len(attention) == len(routed.gca_layers)
        for (scores, mass), read in zip(reads, attention, strict=True):  # (B, H_kv, C) x 2, (B, H, M)
            b, h, _ = read.shape
            n_kv = scores.shape[1]
            per_chunk = read.view(b, n_kv, h // n_kv, 3, 8).sum(-1)  # (B, H_kv, G, C)
            assert scores[1, :, 2].eq(float("-inf")).all() and mass[1, :, 2].eq(0).all()
            if k == 1:
                chosen = torch.nn.functional.one_hot(scores.argmax(-1), 3).bool()  # (B, H_kv, C)
                assert ((per_chunk > 0) == chosen[:, :, None]).all()
            else:
                torch.testing.assert_close(mass, per_chunk.mean(2))
                torch.testing.assert_close(mass.sum(-1), torch.ones(b, n_kv))


def test_save_and_load_keep_the_routing(checkpoint_root, tmp_path):
    _, routed = routed_pair(checkpoint_root, "cross", k=1, logn_scale=16, routing_loss=0.5)
    apply_lora(routed, LoraPlan(decoder=LoraSettings(rank=4)))
    set_trainable(routed, decoder="lora")
    with torch.no_grad():
        for name, param in routed.named_parameters():
            if ".router." in name or "lora_B" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    ids = random_ids(2, 9, vocab=DEC_VOCAB, seed=2)
    mem, mask = memory_batch()
    expected = logits(routed, ids, mem, mask)
    routed.save_pretrained(tmp_path / "run")
    loaded = AwarenessModel.from_pretrained(tmp_path / "run").eval()
    assert (loaded.reading.top_k, loaded.reading.logn_scale, loaded.reading.routing_loss) == (1, 16, 0.5)
    torch.testing.assert_close(logits(loaded, ids, mem, mask), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="missing"):  # a model without routers cannot take these weights
        pair(checkpoint_root, "cross").load_added_weights(tmp_path / "run" / "awareness.safetensors")


@pytest.mark.parametrize("fusion", FUSIONS)
def test_summaries_per_chunk_keep_parity_save_load_and_refuse_a_length_they_do_not_divide(checkpoint_root, fusion,
                                                                                         tmp_path):
    full, routed = routed_pair(checkpoint_root, fusion, k=3, summaries=4)  # memory_batch: 3 chunks of 8
    ids = random_ids(2, 6, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch()
    with torch.no_grad():
        torch.testing.assert_close(logits(routed, ids, mem, mask), logits(full, ids, mem, mask))  # k keeps all
    routed.reading = replace(routed.reading, top_k=1)
    with torch.no_grad():  # 4 summary keys a chunk: each of a two-token block
        assert routed.prepare_memory(mem, mask).layers[routed.gca_layers[-1]].routing.summary.shape[2] == 3 * 4
    expected = logits(routed, ids, mem, mask)
    routed.save_pretrained(tmp_path / "run")
    loaded = AwarenessModel.from_pretrained(tmp_path / "run").eval()
    assert (loaded.reading.summaries, loaded.reading.top_k) == (4, 3)  # saved as built
    loaded.reading = replace(loaded.reading, top_k=1)
    torch.testing.assert_close(logits(loaded, ids, mem, mask), expected, rtol=1e-5, atol=1e-5)
    _, odd = routed_pair(checkpoint_root, fusion, k=1, summaries=3)
    with pytest.raises(ValueError, match=r"memory_summaries \(3\) must divide the memory's chunk length \(8\)"):
        logits(odd, ids, mem, mask)
    with pytest.raises(ValueError, match="memory_summaries must be >= 1"):
        pair(checkpoint_root, fusion, reading=MemoryReading(top_k=1, summaries=0))


def test_chunked_memory_states_route_as_memory_ids_do(checkpoint_root):
    _, routed = routed_pair(checkpoint_root, "gca", k=1)
    ids = random_ids(2, 6, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch()
    mask[0, 1, 5:] = 0
    states, states_mask = routed.encode_memory(mem, mask)  # (B, C*L, H_enc)
    chunked = dict(memory_states=states.view(2, 3, 8, -1), memory_states_mask=states_mask.view(2, 3, 8))
    with torch.no_grad():
        torch.testing.assert_close(routed(input_ids=ids, **chunked).logits, logits(routed, ids, mem, mask))
        with pytest.raises(ValueError, match=r"\(B, C, L, H_enc\)"):
            routed(input_ids=ids, memory_states=states, memory_states_mask=states_mask)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_routers_add_one_small_projection_per_block(fusion):
    """k/v-sized: hidden x (kv heads x head_dim) and an RMSNorm per block; the closed form counts them."""
    added = {}
    for k in (0, 4):
        model = build_pair("proto1", device="meta", fusion=fusion, reading=MemoryReading(top_k=k))
        added[k] = sum(p.numel() for n, p in model.named_parameters() if ".cross_attention." in n
                       or n.startswith("memory_projection."))
    d = model.decoder.config
    shape = dict(hidden_size=d.hidden_size, num_heads=d.num_attention_heads, num_kv_heads=d.num_key_value_heads,
                 head_dim=d.head_dim, num_gca_layers=len(model.gca_layers), encoder_hidden_size=d.hidden_size)
    assert added[4] - added[0] == gca_parameter_count(**shape, router=True) - gca_parameter_count(**shape)
    assert added[4] - added[0] == len(model.gca_layers) * (d.hidden_size * d.num_key_value_heads * d.head_dim
                                                           + d.head_dim)


def test_refusals(checkpoint_root):
    with pytest.raises(ValueError, match="fusion='merged'"):
        pair(checkpoint_root, "merged", reading=MemoryReading(top_k=2))
    with pytest.raises(ValueError, match="fusion='merged'"):
        pair(checkpoint_root, "merged", reading=MemoryReading(logn_scale=64))
    with pytest.raises(ValueError, match="memory_top_k must be"):
        pair(checkpoint_root, "gca", reading=MemoryReading(top_k=-1))
    with pytest.raises(ValueError, match="n_train >= 2"):
        pair(checkpoint_root, "gca", reading=MemoryReading(logn_scale=1))
    with pytest.raises(ValueError, match="built with memory_top_k > 0"):
        pair(checkpoint_root, "gca").reading = MemoryReading(top_k=2)
    with pytest.raises(ValueError, match="memory_chunk_weights must be one of"):
        pair(checkpoint_root, "gca", reading=MemoryReading(top_k=2, chunk_weights="chunks"))
    for reading_options in (dict(), dict(top_k=2, logn_scale=64)):
        with pytest.raises(ValueError, match="needs memory_top_k > 0 and memory_logn_scale 0"):
            pair(checkpoint_root, "gca", reading=MemoryReading(chunk_weights="router", **reading_options))


# --------------------------------------------------------------------------------------------- the logn scale
@pytest.mark.parametrize("fusion", FUSIONS)
def test_logn_scale_changes_only_rows_reading_more_than_n_train(checkpoint_root, fusion):
    """Row 0 reads 24 real memory tokens, row 1 8. Off, and n_train >= 24, it is today's model exactly; n_train = 16
    changes row 0 only."""
    base = reading(pair(checkpoint_root, fusion))
    ids = random_ids(2, 7, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch()
    mask[1, 1:, 4:] = 0
    mask[1, 0, :] = 0
    expected = logits(base, ids, mem, mask)
    for n_train, changed in ((24, False), (1000, False), (16, True)):
        base.reading = replace(base.reading, logn_scale=n_train)
        out = logits(base, ids, mem, mask)
        assert torch.equal(out[1], expected[1])
        assert torch.equal(out[0], expected[0]) != changed
    base.reading = replace(base.reading, logn_scale=0)
    assert torch.equal(logits(base, ids, mem, mask), expected)


@pytest.mark.parametrize("fusion", FUSIONS)
def test_router_weighted_read_of_long_blocks_equals_the_gathered_read_with_gradients(checkpoint_root, fusion,
                                                                                    monkeypatch):
    """Long query blocks (training) attend inside every chunk and weigh the unchosen 0 instead of copying each
    query's chunks out: same logits and same gradients as the gathered read, padded chunks and packed rows too."""
    _, routed = routed_pair(checkpoint_root, fusion, k=2, chunk_weights="router")
    routed.train()
    ids = random_ids(2, 8, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch(chunks=4)
    mask[1, 3] = 0
    mask[1, 2, 4:] = 0
    a, b = random_ids(1, 5, vocab=DEC_VOCAB, seed=6), random_ids(1, 4, vocab=DEC_VOCAB, seed=7)
    mem_a, mem_b = random_ids(1, 2, 8, vocab=ENC_VOCAB, seed=8), random_ids(1, 3, 8, vocab=ENC_VOCAB, seed=9)
    packed = dict(input_ids=torch.cat([a, b], dim=1), position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3]]),
                  segment_ids=torch.tensor([[0] * 5 + [1] * 4]), memory_input_ids=torch.cat([mem_a, mem_b], dim=1),
                  memory_attention_mask=torch.ones(1, 5, 8, dtype=torch.long),
                  memory_segment_ids=torch.tensor([[0, 0, 1, 1, 1]]))
    for inputs in (dict(input_ids=ids, memory_input_ids=mem, memory_attention_mask=mask), packed):
        results = []
        for gathered in (True, False):
            monkeypatch.setattr(gca, "_reads_gathered", lambda routing, queries, device, g=gathered: g)
            routed.zero_grad()
            out = routed(**inputs, labels=inputs["input_ids"])
            out.loss.backward()
            with torch.no_grad():  # training with labels returns no logits (models/loss.py): the same read without
                logits = routed(**inputs).logits
            results.append((logits, {n: p.grad.clone() for n, p in routed.named_parameters()
                                    if p.grad is not None}))
        (want, want_grads), (got, got_grads) = results
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert got_grads.keys() == want_grads.keys() and any(".router." in n for n in got_grads)
        for name in want_grads:
            torch.testing.assert_close(got_grads[name], want_grads[name], rtol=1e-4, atol=1e-6)


def test_the_auto_path_gathers_for_few_queries_and_for_the_router_read_of_many_chunks_on_cpu():
    """Which form reads the chosen chunks (the same result either way, tested above): gathered for a decoding step's
    few queries; for a long block the whole memory, except the router-weighted read on CPU from 10 x k chunks, where
    the copies cost less than attending every chunk; a forced path is kept."""
    def routing(chunks: int, weights: str = "router", path: str = "auto") -> ChunkRouting:
        return ChunkRouting(summary=torch.zeros(1, NKV, chunks, HD), chunk_len=L, top_k=2, chunk_mask=None,
                            weights=weights, path=path)

    cpu, accelerator = torch.device("cpu"), torch.device("cuda")  # only the device's type is read
    assert gca._reads_gathered(routing(5, "attention"), 2, cpu) and gca._reads_gathered(routing(5), 2, accelerator)
    assert not gca._reads_gathered(routing(19), 80, cpu)
    assert gca._reads_gathered(routing(20), 80, cpu)
    assert not gca._reads_gathered(routing(20), 80, accelerator)
    assert not gca._reads_gathered(routing(64, "attention"), 80, cpu)
    assert not gca._reads_gathered(routing(64, path="masked"), 80, cpu)
    assert gca._reads_gathered(routing(4, path="gathered"), 80, accelerator)


def test_a_decoding_steps_gather_copies_its_chunks_not_the_memory(checkpoint_root):
    """One query's k chunks come out of the memory's own keys and values (a transposed projection): no operation of
    the gather makes a tensor the memory's size, which a decoding step at 64k memory tokens paid per layer (2.7x its
    1k time, caught by the efficiency suite)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestOutput(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in [] if func.is_view else out if isinstance(out, (tuple, list)) else [out]:  # views copy nothing
                if isinstance(t, torch.Tensor):
                    LargestOutput.largest = max(LargestOutput.largest, t.numel())
            return out

    _, routed = routed_pair(checkpoint_root, "gca", k=2)
    mem, mask = memory_batch(b=1, chunks=32)
    kv = next(iter(routed.prepare_memory(mem, mask).layers.values()))
    chosen = torch.tensor([[[[3, 17]]]]).expand(1, kv.key.shape[1], 1, 2)  # (B_mem, H_kv, Q = 1, k)
    with LargestOutput():
        key, value, _ = gca._gather_chunks(kv, chosen)
    assert key.shape[-3:] == (2, kv.routing.chunk_len, kv.key.shape[-1])
    torch.testing.assert_close(key[0, :, 0, 1], kv.key[0, :, 17 * kv.routing.chunk_len:18 * kv.routing.chunk_len])
    assert LargestOutput.largest <= key.numel() < kv.key.numel() / 8
