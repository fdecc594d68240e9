"""AwarenessModel against transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM on the same checkpoints."""

import threading

import pytest
import torch
from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

from models import AwarenessModel, build_pair, set_trainable
from models.awareness import allowing_memory_keyword
from pipelines.train.configs.stage import ModelConfig
from pipelines.train.model import prepare_model
from tests.conftest import open_gates, random_ids

DEC_VOCAB, ENC_VOCAB = 512, 496


def memory_batch(b=2, chunks=3, length=8, seed=1, pad_from=None):
    ids = random_ids(b, chunks, length, vocab=ENC_VOCAB, seed=seed)
    mask = torch.ones_like(ids)
    if pad_from is not None:
        mask[-1, -1, pad_from:] = 0  # the last row's last chunk is padded
    return ids, mask


@pytest.mark.parametrize(("fixture", "reference_cls", "directory"), [
    ("tiny", Qwen3ForCausalLM, "tiny-qwen3"),
    ("tiny_moe", Qwen3MoeForCausalLM, "tiny-qwen3-moe"),
])
def test_gates_at_zero_equal_the_pretrained_decoder(request, checkpoint_root, fixture, reference_cls, directory):
    model = request.getfixturevalue(fixture)
    reference = reference_cls.from_pretrained(checkpoint_root / directory).eval()
    ids = random_ids(2, 12, vocab=DEC_VOCAB, seed=0)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :3] = 0  # left padding
    mem, mem_mask = memory_batch()
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=attention_mask, labels=ids)
        without = model(input_ids=ids, attention_mask=attention_mask, labels=ids)
        with_memory = model(input_ids=ids, attention_mask=attention_mask, labels=ids,
                            memory_input_ids=mem, memory_attention_mask=mem_mask)
    for out in (without, with_memory):
        torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-5)
    assert with_memory.gca_memory is not None and without.gca_memory is None


def test_open_gates_read_the_memory_content(tiny):
    open_gates(tiny)
    ids = random_ids(2, 10, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch()
    other = mem.clone()
    other[0, 1, 3] = (other[0, 1, 3] + 1) % ENC_VOCAB  # one token of row 0's memory
    with torch.no_grad():
        a = tiny(input_ids=ids, memory_input_ids=mem, memory_attention_mask=mask).logits
        b = tiny(input_ids=ids, memory_input_ids=other, memory_attention_mask=mask).logits
    assert (a[0] - b[0]).abs().max() > 1e-4
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)  # the other row's memory is untouched


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
def test_padded_memory_has_no_effect(checkpoint_root, attention):
    model = open_gates(build_pair("tiny", checkpoint_root=checkpoint_root, encoder_attention=attention).eval())
    ids = random_ids(2, 10, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch(pad_from=5)
    noisy = mem.clone()
    noisy[-1, -1, 5:] = random_ids(3, vocab=ENC_VOCAB, seed=9)  # different content in padded slots
    extra_chunk = torch.cat([mem, torch.zeros_like(mem[:, :1])], dim=1)  # plus one all-padding chunk
    extra_mask = torch.cat([mask, torch.zeros_like(mask[:, :1])], dim=1)
    left = mem.clone()
    left_mask = mask.clone()
    left[-1, -1] = torch.cat([mem[-1, -1, 5:] * 0, mem[-1, -1, :5]])  # same chunk, padded on the left
    left_mask[-1, -1] = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    with torch.no_grad():
        base = model(input_ids=ids, memory_input_ids=mem, memory_attention_mask=mask).logits
        for m, mm in ((noisy, mask), (extra_chunk, extra_mask), (left, left_mask)):
            out = model(input_ids=ids, memory_input_ids=m, memory_attention_mask=mm).logits
            torch.testing.assert_close(out, base, rtol=1e-5, atol=1e-5)


def test_bidirectional_encoder_sees_the_whole_chunk(checkpoint_root):
    mem, mask = memory_batch(b=1, chunks=1)
    later = mem.clone()
    later[0, 0, -1] = (later[0, 0, -1] + 1) % ENC_VOCAB  # change only the chunk's last token
    first_token = {}
    for attention in ("causal", "bidirectional"):
        model = build_pair("tiny", checkpoint_root=checkpoint_root, encoder_attention=attention)
        with torch.no_grad():
            a, _ = model.encode_memory(mem, mask)
            b, _ = model.encode_memory(later, mask)
        first_token[attention] = (a[0, 0] - b[0, 0]).abs().max().item()
    assert first_token["causal"] == 0
    assert first_token["bidirectional"] > 1e-4


def test_precomputed_memory_states_equal_memory_ids(tiny):
    open_gates(tiny)
    ids = random_ids(2, 10, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch(pad_from=4)
    with torch.no_grad():
        states, states_mask = tiny.encode_memory(mem, mask)  # a memory store keeps these
        from_ids = tiny(input_ids=ids, memory_input_ids=mem, memory_attention_mask=mask).logits
        from_states = tiny(input_ids=ids, memory_states=states, memory_states_mask=states_mask).logits
    torch.testing.assert_close(from_states, from_ids, rtol=0, atol=0)
    assert states.shape == (2, 24, 48) and states_mask.sum() == 2 * 24 - 4


def test_cached_decoding_equals_full_forward(tiny):
    open_gates(tiny)
    prompt = random_ids(2, 6, vocab=DEC_VOCAB, seed=0)
    continuation = random_ids(2, 5, vocab=DEC_VOCAB, seed=1)
    full_ids = torch.cat([prompt, continuation], dim=1)
    mem, mask = memory_batch(pad_from=2)
    with torch.no_grad():
        full = tiny(input_ids=full_ids, memory_input_ids=mem, memory_attention_mask=mask).logits
    torch.testing.assert_close(cached_logits(tiny, prompt, continuation, mem, mask), full, rtol=1e-4, atol=1e-5)


def cached_logits(model, prompt, continuation, mem=None, mask=None, memory=None):
    """The prompt's logits, then each continuation token's, one at a time from the cache and the memory encoded
    once (or a prepared `memory`, a GCAMemory): (B, prompt + continuation, V)."""
    with torch.no_grad():
        read = {"gca_memory": memory} if memory is not None else {"memory_input_ids": mem,
                                                                   "memory_attention_mask": mask}
        step = model(input_ids=prompt, **read, use_cache=True)
        logits, cache, memory = [step.logits], step.cache, step.gca_memory
        for t in range(continuation.shape[1]):
            step = model(input_ids=continuation[:, t : t + 1], gca_memory=memory, cache=cache,
                         use_cache=True)
            logits.append(step.logits)
            cache = step.cache
    return torch.cat(logits, dim=1)


def greedy_by_full_forwards(model, prompt, mem, mask, steps):
    ids = prompt
    for _ in range(steps):
        with torch.no_grad():
            logits = model(input_ids=ids, memory_input_ids=mem, memory_attention_mask=mask).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def test_greedy_generate_equals_argmax_of_full_forwards(tiny):
    open_gates(tiny, 1.5)
    prompt = random_ids(2, 5, vocab=DEC_VOCAB, seed=3)
    mem, mask = memory_batch(pad_from=3)
    generated = tiny.generate(prompt, memory_input_ids=mem, memory_attention_mask=mask, max_new_tokens=6,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(generated, greedy_by_full_forwards(tiny, prompt, mem, mask, 6))


def test_memory_is_encoded_once_per_generation(tiny):
    open_gates(tiny)
    calls = {"encoder": 0, "projection": 0}
    tiny.memory_encoder.encoder.register_forward_hook(lambda *_: calls.__setitem__("encoder", calls["encoder"] + 1))
    block = tiny.gca_blocks()[tiny.gca_layers[0]]
    project = block.project_memory

    def counting(*args, **kwargs):
        calls["projection"] += 1
        return project(*args, **kwargs)

    block.project_memory = counting
    mem, mask = memory_batch()
    tiny.generate(random_ids(2, 4, vocab=DEC_VOCAB, seed=0), memory_input_ids=mem, memory_attention_mask=mask,
                  max_new_tokens=8, num_beams=3, eos_token_id=None, pad_token_id=0)
    assert calls == {"encoder": 1, "projection": 1}


@pytest.mark.parametrize("mode", [
    dict(do_sample=False),
    dict(num_beams=3),
    dict(num_beams=3, num_return_sequences=2),
    dict(do_sample=True, top_k=20, num_return_sequences=2),
])
def test_each_row_gets_the_answer_it_gets_alone(tiny, mode):
    """A batch of two different memories (of different lengths) gives each row what it gets on its own."""
    open_gates(tiny, 1.5)
    prompt = random_ids(2, 5, vocab=DEC_VOCAB, seed=4)
    mem, mask = memory_batch(seed=5)
    mask[1, 2:] = 0  # row 1's memory is two chunks long, the third is padding
    kwargs = dict(max_new_tokens=6, eos_token_id=None, pad_token_id=0, **mode)
    torch.manual_seed(0)
    together = tiny.generate(prompt, memory_input_ids=mem, memory_attention_mask=mask, **kwargs)
    alone = []
    for row, chunks in ((0, 3), (1, 2)):
        torch.manual_seed(0)
        alone.append(tiny.generate(prompt[row : row + 1], memory_input_ids=mem[row : row + 1, :chunks],
                                   memory_attention_mask=mask[row : row + 1, :chunks], **kwargs))
    per_row = together.shape[0] // 2
    if mode.get("do_sample"):  # sampling draws different random numbers in a batch; the memory still separates rows
        assert together.shape == (2 * per_row, 11)
        return
    assert torch.equal(together[:per_row], alone[0]) and torch.equal(together[per_row:], alone[1])
    assert not torch.equal(alone[0][:, 5:], alone[1][:, 5:])


def test_sampling_depends_on_memory_and_seed(tiny):
    open_gates(tiny, 1.5)
    prompt = random_ids(1, 5, vocab=DEC_VOCAB, seed=4)
    mem, mask = memory_batch(b=1, seed=5)
    other = random_ids(1, 3, 8, vocab=ENC_VOCAB, seed=6)

    def sample(memory, seed):
        torch.manual_seed(seed)
        return tiny.generate(prompt, memory_input_ids=memory, max_new_tokens=8, do_sample=True, top_k=50,
                             eos_token_id=None, pad_token_id=0)

    assert torch.equal(sample(mem, 0), sample(mem, 0))
    assert not torch.equal(sample(mem, 0), sample(other, 0))


def test_moe_decoder_generates_with_memory(tiny_moe):
    open_gates(tiny_moe)
    prompt = random_ids(2, 5, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch()
    out = tiny_moe.generate(prompt, memory_input_ids=mem, memory_attention_mask=mask, max_new_tokens=4,
                            num_beams=2, eos_token_id=None, pad_token_id=0)
    assert out.shape == (2, 9)
    assert torch.equal(out[:, :5], prompt)


def test_allowing_memory_keyword_lets_transformers_generate_read_the_memory(tiny):
    """transformers' generate() refuses `gca_memory` (forward does not name it); inside allowing_memory_keyword,
    nested too, it takes it and its first step scores what the model's forward over the memory gives; after, the
    decoder refuses it again, with nothing left on it. A transformers that changes the check it wraps fails here."""
    open_gates(tiny)
    prompt = random_ids(2, 5, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch(pad_from=3)
    memory = tiny.prepare_memory(mem, mask)
    settings = dict(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0,
                    return_dict_in_generate=True, output_logits=True)
    with pytest.raises(ValueError, match="gca_memory"):
        tiny.decoder.generate(prompt, gca_memory=memory, **settings)
    with torch.no_grad(), allowing_memory_keyword(tiny.decoder):
        with allowing_memory_keyword(tiny.decoder):
            inner = tiny.decoder.generate(prompt, gca_memory=memory, **settings)
        outer = tiny.decoder.generate(prompt, gca_memory=memory, **settings)
        read = tiny(input_ids=prompt, gca_memory=memory).logits[:, -1]
        unread = tiny(input_ids=prompt).logits[:, -1]
    assert torch.equal(inner.sequences, outer.sequences)
    torch.testing.assert_close(outer.logits[0], read, rtol=1e-5, atol=1e-5)
    assert (read - unread).abs().max() > 1e-3  # the memory mattered to the step compared
    assert "_validate_model_kwargs" not in vars(tiny.decoder) and "_gca_generates" not in vars(tiny.decoder)
    with pytest.raises(ValueError, match="gca_memory"):
        tiny.decoder.generate(prompt, gca_memory=memory, **settings)


def test_generate_from_several_threads_at_once_answers_as_alone(tiny):
    """`mlflow models serve` runs concurrent requests' predict in threads over one model: every generate succeeds and
    gives what it gives alone, and the decoder is left as it was (no generate-time hook left behind)."""
    open_gates(tiny)
    mem, mask = memory_batch()
    prompts = [random_ids(1, 5, vocab=DEC_VOCAB, seed=s) for s in range(4)]

    def answer(prompt):
        return tiny.generate(prompt, memory_input_ids=mem[:1], memory_attention_mask=mask[:1], max_new_tokens=4,
                             do_sample=False, eos_token_id=None, pad_token_id=0)

    alone = [answer(p) for p in prompts]
    results, errors = {}, []

    def worker(i):
        try:
            for _ in range(5):
                results.setdefault(i, []).append(answer(prompts[i]))
        except Exception as error:  # noqa: BLE001 - collected, asserted below
            errors.append(repr(error))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert all(torch.equal(out, alone[i]) for i, outs in results.items() for out in outs)
    assert "_validate_model_kwargs" not in vars(tiny.decoder) and "_gca_generates" not in vars(tiny.decoder)


def test_only_gca_trains_by_default_and_gradient_checkpointing_matches(checkpoint_root):
    def grads(checkpointing: bool):
        torch.manual_seed(0)  # the same GCA initialisation for both models
        model = open_gates(build_pair("tiny", checkpoint_root=checkpoint_root)).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        ids = random_ids(2, 10, vocab=DEC_VOCAB, seed=0)
        mem, mask = memory_batch(pad_from=3)
        model(input_ids=ids, labels=ids, memory_input_ids=mem, memory_attention_mask=mask).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain and all(".cross_attention." in n or n.startswith("memory_projection.") for n in plain)
    assert "memory_projection.weight" in plain and all(g.abs().sum() > 0 for g in plain.values())
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-4, atol=1e-6)


def test_awareness_model_is_importable_as_documented():
    import models

    assert models.AwarenessModel is AwarenessModel
    assert {"tiny", "proto1", "proto2", "dev", "scale", "prod"} <= set(models.PAIRS)


def test_moe_router_loss_passes_through(tiny_moe, checkpoint_root):
    reference = Qwen3MoeForCausalLM.from_pretrained(checkpoint_root / "tiny-qwen3-moe").eval()
    ids = random_ids(2, 12, vocab=DEC_VOCAB, seed=0)
    mem, mask = memory_batch()
    with torch.no_grad():
        expected = reference(input_ids=ids, labels=ids, output_router_logits=True)
        out = tiny_moe(input_ids=ids, labels=ids, memory_input_ids=mem, output_router_logits=True)
    assert expected.aux_loss is not None and expected.aux_loss > 0
    torch.testing.assert_close(out.aux_loss, expected.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)  # includes the router loss


def test_encoder_gradient_scale(checkpoint_root):
    def encoder_grad(scale):
        torch.manual_seed(0)  # the same GCA initialisation for both models
        model = open_gates(build_pair("tiny", checkpoint_root=checkpoint_root))
        set_trainable(model, encoder="full")
        model.memory_encoder.grad_scale = scale
        ids = random_ids(2, 8, vocab=DEC_VOCAB, seed=0)
        mem, mask = memory_batch()
        model(input_ids=ids, labels=ids, memory_input_ids=mem, memory_attention_mask=mask).loss.backward()
        return model.memory_encoder.encoder.norm.weight.grad, model.memory_projection.weight.grad

    (enc1, proj1), (enc10, proj10) = encoder_grad(1.0), encoder_grad(10.0)
    torch.testing.assert_close(enc10, 10 * enc1, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(proj10, proj1)  # only the encoder's own gradient is scaled


@pytest.mark.slow  # tracing three layer kinds takes minutes on 2 CPU cores
def test_compiled_layers_give_the_eager_loss_and_gradients(checkpoint_root):
    """Regional compile (fullgraph: a graph break fails) of the decoder layers with their GCA blocks and of the
    encoder layers: the same loss and gradients as eager, to 1e-6 (aot_eager keeps torch's own kernels, so what is
    checked is the captured graphs; inductor's generated kernels are checked on a GPU, tests/gpu)."""
    torch.manual_seed(0)
    model = open_gates(prepare_model(build_pair("tiny", checkpoint_root=checkpoint_root),
                                     ModelConfig(pair="tiny", encoder="lora")), 0.5)
    batch = dict(input_ids=random_ids(2, 24, vocab=DEC_VOCAB, seed=0),
                 memory_input_ids=random_ids(2, 3, 16, vocab=ENC_VOCAB, seed=1))

    def step():
        model.zero_grad()
        loss = model(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want_grads = step()
    model.compile_layers(fullgraph=True, backend="aot_eager")
    got_loss, got_grads = step()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    assert got_grads.keys() == want_grads.keys() and any("memory_encoder" in n for n in got_grads)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-6, msg=name)
