"""Loading checkpoints (models/loading.py) from local directories only: each decoder type gets its transformers
class, an encoder loads from an embedding or a causal-LM checkpoint (without its head), dtypes are honoured, and a
directory that is not a usable checkpoint is refused with what to do, naming its role."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import Qwen3ForCausalLM, Qwen3Model, Qwen3MoeForCausalLM

from models.loading import DECODER_CLASSES, check_checkpoint_dir, load_config, load_decoder, load_encoder


def test_each_decoder_type_gets_its_class(checkpoint_root):
    dense, moe = load_decoder(checkpoint_root / "tiny-qwen3"), load_decoder(checkpoint_root / "tiny-qwen3-moe")
    assert type(dense) is Qwen3ForCausalLM and type(moe) is Qwen3MoeForCausalLM
    assert dense.config._attn_implementation == "sdpa" and dense.device.type == "cpu"
    assert sorted(DECODER_CLASSES) == ["qwen3", "qwen3_moe"]


def test_an_encoder_loads_from_a_causal_lm_checkpoint_without_its_head(checkpoint_root):
    encoder = load_encoder(checkpoint_root / "tiny-qwen3-encoder")
    assert type(encoder) is Qwen3Model and encoder.config.vocab_size == 496
    trunk = load_encoder(checkpoint_root / "tiny-qwen3")  # a decoder checkpoint: its Qwen3Model, no lm_head
    decoder = load_decoder(checkpoint_root / "tiny-qwen3")
    assert not any("lm_head" in name for name, _ in trunk.named_parameters())
    mine, theirs = trunk.state_dict(), decoder.model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_dtypes_are_honoured(checkpoint_root):
    assert load_decoder(checkpoint_root / "tiny-qwen3", dtype=torch.bfloat16).dtype == torch.bfloat16
    assert load_encoder(checkpoint_root / "tiny-qwen3-encoder", dtype=torch.float16).dtype == torch.float16
    saved = json.loads((checkpoint_root / "tiny-qwen3" / "config.json").read_text())
    want = getattr(torch, saved.get("dtype") or saved.get("torch_dtype") or "float32")
    assert load_decoder(checkpoint_root / "tiny-qwen3").dtype == want  # "auto": the checkpoint's own


def test_unusable_directories_are_refused_naming_the_role_and_the_fix(tmp_path, checkpoint_root):
    with pytest.raises(FileNotFoundError, match=r"encoder checkpoint directory .* does not exist: .* never downloads"):
        check_checkpoint_dir(tmp_path / "Qwen3-Embedding-0.6B", "encoder")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="decoder checkpoint .* has no config.json"):
        check_checkpoint_dir(tmp_path / "empty", "decoder")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(checkpoint_root / "tiny-qwen3" / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors weights; convert .* does not unpickle"):
        load_decoder(pickled)
    with pytest.raises(ValueError, match=r"encoder checkpoint .* is a 'qwen3_moe' model; supported: \['qwen3'\]"):
        load_encoder(checkpoint_root / "tiny-qwen3-moe")
    assert load_config(checkpoint_root / "tiny-qwen3", "decoder", DECODER_CLASSES).model_type == "qwen3"
    assert check_checkpoint_dir(str(checkpoint_root / "tiny-qwen3"), "decoder") == checkpoint_root / "tiny-qwen3"
