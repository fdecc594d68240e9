"""The traffic-scene VLM: 196 vision tokens into the seed's small decoder; [YES]/[NO] logits at the last real
position under either padding; the image-withheld control; generate; a local SigLIP checkpoint; and a tiny CPU
training loop on rendered scenes that learns well above the majority rate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import SiglipVisionModel

from models.traffic_vlm import TrafficVLM, YesNoObjective, build_traffic_vlm, last_real_position, tiny_vision_config
from pipelines.data.traffic_scenes import make_row, pixel_values, split_of
from pipelines.data.traffic_tokenizer import NO, YES, build_traffic_tokenizer

YES_ID, NO_ID, PAD_ID = 4, 5, 0


def small_vlm(*, seed: int = 0, image_size: int = 64, vocab: int = 64) -> TrafficVLM:
    """A tiny random VLM: 64x64 images, patch 16 (16 vision tokens of width 48), a 2-layer 32-wide decoder."""
    torch.manual_seed(seed)
    return build_traffic_vlm(
        yes_id=YES_ID, no_id=NO_ID,
        vision_config=tiny_vision_config(image_size=image_size, patch_size=16, hidden_size=48, layers=1, heads=4),
        vocab_size=vocab, hidden_size=32, intermediate_size=64, layers=2, heads=4, kv_heads=2, max_positions=32,
    ).eval()


def images(batch: int, size: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_default_model_reads_196_vision_tokens_into_the_seed_decoder():
    model = build_traffic_vlm(yes_id=YES_ID, no_id=NO_ID).eval()
    config = model.decoder.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (500, 512, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.max_position_embeddings) == (8, 2, 128)
    assert config.memory_hidden_size == model.vision.config.hidden_size
    with torch.no_grad():
        tokens = model.vision_tokens(images(2, 224))
    assert tokens.shape == (2, 196, model.vision.config.hidden_size)
    ids = torch.tensor([[1, 10, 15, 35, 38, 6]])
    assert model.yes_no_logits(images(1, 224), ids).shape == (1, 2)


def test_yes_no_objective_is_the_cross_entropy_over_the_yes_no_logits():
    model = small_vlm()
    ids, mask, labels = torch.tensor([[1, 10, 15, 6], [1, 11, 6, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]), \
        torch.tensor([0, 1])
    out = YesNoObjective(model)(images(2), ids, labels, attention_mask=mask)
    logits = model.yes_no_logits(images(2), ids, mask)  # (B, 2): [YES], [NO]
    torch.testing.assert_close(out.logits, logits)
    torch.testing.assert_close(out.loss, F.cross_entropy(logits, labels))


def test_last_real_position_left_and_right_padding():
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert last_real_position(None, right).tolist() == [2, 4]
    assert last_real_position(None, left).tolist() == [4, 4]
    assert last_real_position(torch.zeros(3, 7), None).tolist() == [6, 6, 6]


@pytest.mark.parametrize("side", ["left", "right"])
def test_yes_no_logits_are_the_lm_heads_logits_at_the_last_real_token(side):
    model = small_vlm()
    questions = [[1, 10, 15, 35, 38, 6], [1, 11, 12, 6]]
    width = max(map(len, questions))
    pad = [[PAD_ID] * (width - len(q)) for q in questions]
    rows = [p + q if side == "left" else q + p for p, q in zip(pad, questions)]
    ids = torch.tensor(rows)
    mask = (ids != PAD_ID).long()
    pixels = images(2)
    with torch.no_grad():
        got = model.yes_no_logits(pixels, ids, mask)
        logits = model(pixels, ids, mask).logits  # (B, T, V)
        for b, question in enumerate(questions):
            last = width - 1 if side == "left" else len(question) - 1
            torch.testing.assert_close(got[b], logits[b, last, [YES_ID, NO_ID]])
            alone = model.yes_no_logits(pixels[b:b + 1], torch.tensor([question]))  # unpadded
            torch.testing.assert_close(got[b], alone[0], atol=1e-5, rtol=1e-5)
        assert model.classify(pixels, ids, mask).tolist() == (got[:, 0] > got[:, 1]).tolist()


def test_packed_questions_each_get_the_logits_they_get_alone():
    """Training packs a scene's questions into one row (position_ids restart per question, no attention mask):
    each question's logits must equal the question asked alone, whatever stands before it."""
    model = small_vlm()
    questions = [[1, 10, 15, 35, 38, 6], [1, 11, 12, 6], [1, 20, 6]]
    orders = [(0, 1, 2), (2, 0, 1)]
    ids, positions, answers = [], [], []
    for order in orders:
        row, pos, ends = [], [], []
        for k in order:
            row += questions[k]
            pos += range(len(questions[k]))
            ends.append(len(row) - 1)
        ids.append(row + [PAD_ID] * 2), positions.append(pos + [0, 1]), answers.append(ends)  # a [PAD] tail
    pixels = images(2)
    with torch.no_grad():
        packed = model.yes_no_logits(pixels, torch.tensor(ids), position_ids=torch.tensor(positions),
                                     answer_positions=torch.tensor(answers))  # (2, 3, 2)
        for b, order in enumerate(orders):
            for q, k in enumerate(order):
                alone = model.yes_no_logits(pixels[b:b + 1], torch.tensor([questions[k]]))[0]
                torch.testing.assert_close(packed[b, q], alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="attention_mask=None"):
        model.yes_no_logits(pixels, torch.tensor(ids), torch.ones(2, len(ids[0])),
                            answer_positions=torch.tensor(answers))


def test_withholding_the_image_zeroes_the_memory_and_changes_the_logits():
    model = small_vlm()
    pixels, ids = images(3), torch.tensor([[1, 10, 15, 35, 38, 6]] * 3)
    with torch.no_grad():
        seen = model.yes_no_logits(pixels, ids)
        withheld = model.yes_no_logits(pixels, ids, withhold_image=True)
        other_image = model.yes_no_logits(images(3, seed=1), ids, withhold_image=True)
        zero_memory = model.decoder(input_ids=ids, memory=torch.zeros(3, 16, 48)).logits[:, -1, [YES_ID, NO_ID]]
    assert not torch.allclose(seen, withheld, atol=1e-4)
    torch.testing.assert_close(withheld, other_image)  # no image information left
    torch.testing.assert_close(withheld, zero_memory)
    assert not torch.allclose(seen[0], seen[1], atol=1e-5)  # different images, different answers' logits


def test_generate_reads_the_image():
    model = small_vlm()
    pixels, ids = images(2), torch.tensor([[1, 10, 15, 35], [1, 11, 12, 6]])
    out = model.generate(pixels, ids, torch.ones_like(ids), max_new_tokens=3, do_sample=False, eos_token_id=None,
                         pad_token_id=PAD_ID)
    assert out.shape == (2, 7) and torch.equal(out[:, :4], ids)
    with torch.no_grad():
        first = model(pixels, ids).logits[:, -1].argmax(-1)
    assert torch.equal(out[:, 4], first)
    direct = model.decoder.generate(input_ids=ids, memory=model.vision_tokens(pixels), max_new_tokens=3,
                                    do_sample=False, eos_token_id=None, pad_token_id=PAD_ID)
    assert torch.equal(out, direct)


def test_vision_tower_loads_from_a_local_safetensors_checkpoint(tmp_path):
    torch.manual_seed(3)
    vision = SiglipVisionModel(tiny_vision_config(image_size=64, hidden_size=48, layers=1, heads=4)).eval()
    vision.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").is_file()
    model = build_traffic_vlm(yes_id=YES_ID, no_id=NO_ID, vision_path=tmp_path, vocab_size=64, hidden_size=32,
                              intermediate_size=64, layers=1, heads=4, kv_heads=2, max_positions=32).eval()
    pixels = images(1)
    with torch.no_grad():
        torch.testing.assert_close(model.vision_tokens(pixels), vision(pixel_values=pixels).last_hidden_state)
    assert model.decoder.config.memory_hidden_size == 48


def scene_batch(seeds: list[int], tokenizer, question_types: tuple[str, ...]):
    rows = [make_row(s, size=64, question_types=question_types) for s in seeds]
    encodings = tokenizer.encode_batch([r["question"] for r in rows])
    return (torch.from_numpy(pixel_values([r["png"] for r in rows])),
            torch.tensor([e.ids for e in encodings]), torch.tensor([e.attention_mask for e in encodings]),
            torch.tensor([0 if r["answer"] == "yes" else 1 for r in rows]))  # class 0 = [YES]


def test_tiny_training_loop_learns_held_out_scenes():
    """200 rendered scenes at 64x64 (three question types: light, left lane, stop sign), 200 AdamW steps on the
    [YES]/[NO] logits: held-out accuracy well above the majority rate, and above the image-withheld control."""
    torch.set_num_threads(2)
    tokenizer = build_traffic_tokenizer()
    types = ("light_red", "left_lane_free", "stop_sign")
    train = [s for s in range(400) if split_of(s) == "train"][:200]
    heldout = [s for s in range(400, 2000) if split_of(s) == "heldout"][:120]
    assert not set(train) & set(heldout)
    pixels, ids, mask, labels = scene_batch(train, tokenizer, types)
    held = scene_batch(heldout, tokenizer, types)
    torch.manual_seed(0)
    model = build_traffic_vlm(
        yes_id=tokenizer.token_to_id(YES), no_id=tokenizer.token_to_id(NO),
        vision_config=tiny_vision_config(image_size=64, patch_size=16, hidden_size=64, layers=2, heads=4),
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, layers=2, heads=4, kv_heads=2,
        max_positions=32,
    ).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch = torch.randint(len(train), (32,), generator=generator)
        loss = F.cross_entropy(model.yes_no_logits(pixels[batch], ids[batch], mask[batch]), labels[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    accuracy = (model.classify(*held[:3]) == (held[3] == 0)).float().mean().item()
    withheld = (model.classify(*held[:3], withhold_image=True) == (held[3] == 0)).float().mean().item()
    majority = max((held[3] == 0).float().mean().item(), (held[3] == 1).float().mean().item())
    assert accuracy >= 0.7 and accuracy >= majority + 0.15, (accuracy, majority)
    assert withheld <= accuracy - 0.15, (withheld, accuracy)


def test_cross_attention_map_is_the_layers_softmax_and_rebuilds_its_output():
    """The map's weights, applied to the layer's own values and o_proj, give exactly what the layer's SDPA returned."""
    model = small_vlm()
    pixels, ids = images(2), torch.tensor([[1, 10, 15, 35, 38, 6], [1, 11, 12, 6, 0, 0]])
    mask = (ids != PAD_ID).long()
    for layer in (0, -1):
        weights = model.cross_attention_map(pixels, ids, mask, layer=layer)  # (B, N)
        assert weights.shape == (2, 16)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2))
        attention = model.decoder.model.layers[layer].cross_attn
        seen = {}
        hook = attention.register_forward_hook(lambda m, args, out: seen.update(h=args[0], m=args[1], out=out))
        with torch.no_grad():
            model.yes_no_logits(pixels, ids, mask)
        hook.remove()
        # per head, written out: softmax(q k^T * scale) @ v at each row's last real token, heads joined, o_proj
        last = last_real_position(ids, mask)
        h = seen["h"][torch.arange(2), last]  # (B, d)
        q = attention.q_norm(attention.q_proj(h).view(2, -1, attention.head_dim))  # (B, H, hd)
        k, v = attention.memory_keys_values(seen["m"], None)  # (B, Hkv, N, hd)
        group = q.shape[1] // k.shape[1]
        per_head = torch.stack([(q[:, i, None] * k[:, i // group]).sum(-1) * attention.scaling
                                for i in range(q.shape[1])], 1).softmax(-1)  # (B, H, N)
        torch.testing.assert_close(weights, per_head.mean(1))
        heads = torch.stack([(per_head[:, i, :, None] * v[:, i // group]).sum(1) for i in range(q.shape[1])], 1)
        rebuilt = attention.o_proj(heads.reshape(2, -1))  # (B, d)
        torch.testing.assert_close(rebuilt, seen["out"][torch.arange(2), last], atol=1e-5, rtol=1e-5)


def test_save_and_load_round_trip(tmp_path):
    model = small_vlm(seed=4)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "vision" / "model.safetensors").is_file()
    assert (tmp_path / "decoder" / "model.safetensors").is_file()
    loaded = TrafficVLM.from_pretrained(tmp_path).eval()
    pixels, ids = images(2), torch.tensor([[1, 10, 15, 35, 38, 6]] * 2)
    with torch.no_grad():
        torch.testing.assert_close(loaded.yes_no_logits(pixels, ids), model.yes_no_logits(pixels, ids))
    assert (loaded.yes_id, loaded.no_id) == (YES_ID, NO_ID)
    with pytest.raises(FileNotFoundError, match="traffic_vlm.json"):
        TrafficVLM.from_pretrained(tmp_path / "vision")
