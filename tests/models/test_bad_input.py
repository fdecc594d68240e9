"""Bad input gets an error that names the problem and the fix."""

import json

import pytest
import torch

from models import AwarenessModel, build_pair
from tests.conftest import random_ids


def test_gca_layer_out_of_range_names_the_depth(checkpoint_root):
    with pytest.raises(ValueError, match=r"layers \[4\] outside the decoder's 4 layers \(valid indices 0-3\)"):
        build_pair("tiny", checkpoint_root=checkpoint_root, gca_layers=[2, 4])
    with pytest.raises(ValueError, match="selects no layer of a 48-layer decoder"):
        build_pair("prod", device="meta", gca_layers=[])


def test_memory_ids_outside_the_encoder_vocabulary(tiny):
    ids = random_ids(1, 4, vocab=512, seed=0)
    memory = torch.full((1, 1, 8), 500)  # valid for the 512-id decoder, not for the 496-id encoder
    with pytest.raises(ValueError,
                       match="memory_input_ids holds token id 500, outside the encoder's vocabulary of 496"):
        tiny(input_ids=ids, memory_input_ids=memory)
    with pytest.raises(ValueError, match="input_ids holds token id 512, outside the decoder's vocabulary of 512"):
        tiny(input_ids=torch.full((1, 4), 512))
    with pytest.raises(ValueError, match="tokenize with the tokenizer both checkpoints share"):
        tiny.generate(ids, memory_input_ids=torch.full((1, 1, 8), -1))


def test_memory_longer_than_the_encoder_positions(tiny):
    with pytest.raises(ValueError,
                       match=r"chunks of 300 tokens exceed the encoder's 256 positions.*\[batch, chunks, chunk_len\]"):
        tiny(input_ids=random_ids(1, 4, vocab=512, seed=0), memory_input_ids=torch.zeros(1, 300, dtype=torch.long))


def test_memory_shape_and_batch_mistakes(tiny):
    ids = random_ids(2, 4, vocab=512, seed=0)
    with pytest.raises(ValueError, match=r"must be \[batch, chunks, chunk_len\]"):
        tiny(input_ids=ids, memory_input_ids=torch.zeros(2, 1, 1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="memory_attention_mask shape"):
        tiny(input_ids=ids, memory_input_ids=torch.zeros(2, 8, dtype=torch.long),
             memory_attention_mask=torch.ones(2, 7))
    with pytest.raises(ValueError, match="memory batch 1 differs from the prompt batch 2"):
        tiny.generate(ids, memory_input_ids=torch.zeros(1, 8, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"memory_states must be \(batch, memory_len, 48\)"):
        tiny(input_ids=ids, memory_states=torch.zeros(2, 8, 64))
    with pytest.raises(ValueError, match="either memory_input_ids or memory_states"):
        tiny(input_ids=ids, memory_states=torch.zeros(2, 8, 48), memory_input_ids=torch.zeros(2, 8, dtype=torch.long))


def test_missing_or_unusable_checkpoints(tmp_path, checkpoint_root):
    encoder = checkpoint_root / "tiny-qwen3-encoder"
    with pytest.raises(FileNotFoundError, match="does not exist: pass a local directory .* never downloads"):
        AwarenessModel.from_pretrained_pair(tmp_path / "Qwen3-8B", encoder)
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text((checkpoint_root / "tiny-qwen3" / "config.json").read_text())
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        AwarenessModel.from_pretrained_pair(tmp_path / "pickled", encoder)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "llama" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="is a 'llama' model; supported: \\['qwen3', 'qwen3_moe'\\]"):
        AwarenessModel.from_pretrained_pair(tmp_path / "llama", encoder)


def test_unknown_encoder_attention(checkpoint_root):
    with pytest.raises(ValueError, match="encoder_attention must be one of"):
        build_pair("tiny", checkpoint_root=checkpoint_root, encoder_attention="sideways")
