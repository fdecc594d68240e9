"""save_pretrained writes only what training changes; from_pretrained rebuilds from the base checkpoints."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from models import AwarenessModel, LoraPlan, LoraSettings, MemoryReading, apply_lora, build_pair, set_trainable
from models.awareness import WEIGHTS_NAME
from models.trainable import trainable_modes
from tests.conftest import open_gates, random_ids


def trained_like(model: AwarenessModel) -> AwarenessModel:
    """Gates open and LoRA adapters non-zero, as after training."""
    apply_lora(model, LoraPlan(decoder=LoraSettings(rank=4), gca=LoraSettings(rank=2)))
    set_trainable(model, decoder="lora", gca="full")
    open_gates(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return model


def logits(model, seed=0):
    ids = random_ids(2, 9, vocab=512, seed=seed)
    mem = random_ids(2, 3, 8, vocab=496, seed=seed + 1)
    with torch.no_grad():
        return model(input_ids=ids, memory_input_ids=mem).logits


def test_round_trip_reproduces_logits_and_holds_no_base_weights(tiny, tmp_path):
    trained_like(tiny)
    tiny.save_pretrained(tmp_path / "run")
    saved = load_file(tmp_path / "run" / WEIGHTS_NAME)
    base_names = {n for n in tiny.state_dict() if ".cross_attention." not in n and "lora_" not in n
                  and not n.startswith("memory_projection.")}
    assert saved and not (saved.keys() & base_names)
    assert all(".cross_attention." in n or "lora_" in n or n.startswith("memory_projection.") for n in saved)
    config = json.loads((tmp_path / "run" / "awareness_config.json").read_text())
    assert config["gca_layers"] == [3] and config["lora"]["gca"]["rank"] == 2
    reloaded = AwarenessModel.from_pretrained(tmp_path / "run").eval()
    torch.testing.assert_close(logits(reloaded), logits(tiny), rtol=0, atol=0)
    assert trainable_modes(reloaded) == {"decoder": "lora", "encoder": "frozen", "gca": "full"}
    assert LoraPlan.of(reloaded) == LoraPlan.of(tiny) and LoraPlan.of(tiny).gca.rank == 2
    assert not hasattr(reloaded.config, "lora") and not hasattr(reloaded.config, "trainable")


def test_merged_export_is_standalone_and_plain_transformers(tiny, checkpoint_root, tmp_path):
    trained_like(tiny)
    before = {n: t.clone() for n, t in tiny.state_dict().items()}
    out = tiny.save_pretrained(tmp_path / "merged", merged=True)
    after = tiny.state_dict()  # merged in copies: the live model keeps its adapters and exact base weights
    assert after.keys() == before.keys() and all(torch.equal(after[n], t) for n, t in before.items())
    reloaded = AwarenessModel.from_pretrained(out).eval()
    torch.testing.assert_close(logits(reloaded), logits(tiny), rtol=1e-5, atol=1e-5)
    assert not any("lora_" in n for n in load_file(out / WEIGHTS_NAME))
    assert LoraPlan.of(reloaded) is None and trainable_modes(reloaded) == {"decoder": "frozen", "encoder": "frozen",
                                                                           "gca": "full"}
    # The decoder directory is an ordinary Qwen3 checkpoint: with gates closed the pair equals it exactly.
    plain = Qwen3ForCausalLM.from_pretrained(out / "decoder").eval()
    for block in reloaded.gca_blocks().values():
        block.gate.data.zero_()
    ids = random_ids(2, 9, vocab=512, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        original = Qwen3ForCausalLM.from_pretrained(checkpoint_root / "tiny-qwen3").eval()(input_ids=ids).logits
    assert (plain(input_ids=ids).logits - original).abs().max() > 1e-4  # the LoRA deltas really were merged


def test_moved_base_checkpoints(tiny, tmp_path, checkpoint_root):
    tiny.save_pretrained(tmp_path / "run")
    config_path = tmp_path / "run" / "awareness_config.json"
    config = json.loads(config_path.read_text())
    config["decoder"] = str(tmp_path / "gone")
    config_path.write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="decoder checkpoint directory .*gone.* does not exist"):
        AwarenessModel.from_pretrained(tmp_path / "run")
    model = AwarenessModel.from_pretrained(tmp_path / "run", decoder=checkpoint_root / "tiny-qwen3")
    torch.testing.assert_close(logits(model), logits(tiny))


def test_weights_from_another_placement_are_refused(tiny, tmp_path, checkpoint_root):
    tiny.save_pretrained(tmp_path / "run")
    other = AwarenessModel.from_pretrained_pair(checkpoint_root / "tiny-qwen3", checkpoint_root / "tiny-qwen3-encoder",
                                                gca_layers="last:2")
    with pytest.raises(ValueError, match="does not fit this model.*missing"):
        other.load_added_weights(tmp_path / "run" / WEIGHTS_NAME)
    with pytest.raises(FileNotFoundError, match="awareness_config.json"):
        AwarenessModel.from_pretrained(tmp_path)


def test_an_export_of_format_1_with_flat_reading_keys_loads_as_it_was_saved(checkpoint_root, tmp_path):
    """Exports written before MemoryReading hold the reading options as flat memory_* keys (format 1): they load with
    the same reading and read the same; a format-2 file nests them under "reading"."""
    torch.manual_seed(0)
    reading = MemoryReading(top_k=2, routing_loss=0.5, summaries=2, chunk_weights="router", lexical_routing=1.5,
                            lexical_reading=3.0)
    routed = open_gates(build_pair("tiny", checkpoint_root=checkpoint_root, reading=reading)).eval()
    config_path = routed.save_pretrained(tmp_path / "run") / "awareness_config.json"
    config = json.loads(config_path.read_text())
    assert config["format_version"] == 2 and config["reading"] == dataclasses.asdict(reading)
    flat = {k: v for k, v in config.items() if k != "reading"} | {"format_version": 1}
    flat |= {f"memory_{name}": value for name, value in config["reading"].items()}
    config_path.write_text(json.dumps(flat))
    loaded = AwarenessModel.from_pretrained(tmp_path / "run").eval()
    assert loaded.reading == reading and loaded.config.reading == reading
    torch.testing.assert_close(logits(loaded), logits(routed), rtol=0, atol=0)
