"""The named pairs on the meta device: the real architectures, their sizes, and the GCA parameter formula."""

import dataclasses
from pathlib import Path

import pytest
import torch

from models import PAIRS, build_pair, gca_parameter_count, write_random_checkpoints
from models.pairs import fusion_parameter_table
from models.trainable import is_added_parameter

REAL_PAIRS = ["proto1", "proto2", "dev", "scale", "prod"]


def published_tolerance(stated: str) -> tuple[float, float]:
    """'8.2B' -> (8.2e9, allowed error): 1% or half a unit of the last stated digit, whichever is larger."""
    number = stated.rstrip("B")
    decimals = len(number.partition(".")[2])
    value = float(number) * 1e9
    return value, max(0.01 * value, 0.5 * 10 ** (-decimals) * 1e9)


@pytest.mark.parametrize("name", REAL_PAIRS)
def test_meta_pair_has_the_published_sizes(name):
    model = build_pair(name, device="meta")
    assert model.device.type == "meta"
    decoder = sum(p.numel() for n, p in model.decoder.named_parameters() if not is_added_parameter(n))
    encoder = sum(p.numel() for p in model.memory_encoder.parameters())
    for count, stated in zip((decoder, encoder), PAIRS[name].published_params, strict=True):
        value, allowed = published_tolerance(stated)
        assert abs(count - value) <= allowed, f"{name}: {count / 1e9:.3f}B vs published {stated}"


def test_precise_published_sizes_within_one_percent():
    """The cards that state three digits: Qwen3-8B 8.2B, Qwen3-30B-A3B 30.5B, Qwen3-4B 4.0B."""
    for name, published in (("scale", 8.2e9), ("prod", 30.5e9), ("dev", 4.0e9)):
        decoder = build_pair(name, device="meta").decoder
        count = sum(p.numel() for n, p in decoder.named_parameters() if not is_added_parameter(n))
        assert abs(count - published) / published < 0.01


@pytest.mark.parametrize("name", REAL_PAIRS + ["tiny", "tiny-moe"])
@pytest.mark.parametrize("gca_mlp", [False, True])
def test_gca_parameter_count_equals_closed_form(name, gca_mlp):
    model = build_pair(name, device="meta", gca_mlp=gca_mlp)
    d, e = model.decoder.config, model.memory_encoder.encoder.config
    added = sum(p.numel() for n, p in model.named_parameters() if is_added_parameter(n))
    assert added == gca_parameter_count(
        hidden_size=d.hidden_size, num_heads=d.num_attention_heads, num_kv_heads=d.num_key_value_heads,
        head_dim=d.head_dim, num_gca_layers=len(model.gca_layers), encoder_hidden_size=e.hidden_size,
        mlp_intermediate_size=d.intermediate_size if gca_mlp else None,
    )


@pytest.mark.parametrize(("name", "first", "last"), [("proto1", 19, 27), ("scale", 24, 35), ("prod", 32, 47)])
def test_default_placement_is_the_upper_third(name, first, last):
    model = build_pair(name, device="meta")
    assert model.gca_layers == list(range(first, last + 1))


def test_prod_pair_is_the_moe_decoder():
    model = build_pair("prod", device="meta", dtype=torch.bfloat16)
    assert type(model.decoder).__name__ == "Qwen3MoeForCausalLM"
    assert model.decoder.config.num_experts == 128 and model.decoder.config.num_experts_per_tok == 8
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    # Qwen3-Embedding-8B is 4096 wide, the 30B-A3B decoder 2048: the shared projection maps one to the other
    assert tuple(model.memory_projection.weight.shape) == (2048, 4096)


def test_real_pair_without_checkpoints_says_how_to_get_them(monkeypatch):
    monkeypatch.delenv("AWARENESS_CHECKPOINT_ROOT", raising=False)
    with pytest.raises(ValueError, match="AWARENESS_CHECKPOINT_ROOT.*Qwen3-8B/ and Qwen3-Embedding-8B/"):
        build_pair("scale")
    with pytest.raises(ValueError, match="unknown pair 'huge'; known pairs: tiny"):
        build_pair("huge")


def test_checkpoint_root_loads_the_pair_by_name(checkpoint_root, monkeypatch):
    monkeypatch.setenv("AWARENESS_CHECKPOINT_ROOT", str(checkpoint_root))
    model = build_pair("tiny-moe")
    assert model.config.decoder == str((checkpoint_root / "tiny-qwen3-moe").resolve())


def test_random_checkpoints_are_rewritten_when_the_architecture_changes(tmp_path):
    spec = PAIRS["tiny"]
    decoder_dir, _ = write_random_checkpoints(spec, tmp_path)
    first = (decoder_dir / "model.safetensors").read_bytes()
    write_random_checkpoints(spec, tmp_path)
    assert (decoder_dir / "model.safetensors").read_bytes() == first  # cached
    wider = dataclasses.replace(spec, decoder_config={**spec.decoder_config, "intermediate_size": 96})
    write_random_checkpoints(wider, tmp_path)
    assert (decoder_dir / "model.safetensors").read_bytes() != first  # not a stale cache


def test_a_rewrite_leaves_a_loaded_checkpoint_whole_and_pairs_sharing_a_decoder_never_rewrite_it(tmp_path):
    """A reader that opened the weights before a rewrite (another seed here) still reads the old ones, a new reader
    the new ones: files are replaced, never written in place. tiny and tiny-shared share their decoder, and
    writing one after the other leaves it as it was."""
    from safetensors import safe_open

    decoder_dir, _ = write_random_checkpoints(PAIRS["tiny"], tmp_path)
    weights = decoder_dir / "model.safetensors"
    with safe_open(weights, "pt") as before:
        name = next(iter(before.keys()))
        old = before.get_tensor(name)
        write_random_checkpoints(PAIRS["tiny"], tmp_path, seed=1)
        assert torch.equal(before.get_tensor(name), old)
    with safe_open(weights, "pt") as after:
        assert not torch.equal(after.get_tensor(name), old)
    inode = weights.stat().st_ino
    write_random_checkpoints(PAIRS["tiny-shared"], tmp_path, seed=1)
    assert weights.stat().st_ino == inode  # the shared decoder: not rewritten
    assert not list(tmp_path.glob(".*"))  # no staging directory left behind


def test_tiny_shared_encoder_starts_from_its_decoder(tmp_path):

    model = build_pair("tiny-shared", checkpoint_root=tmp_path)
    encoder, decoder = model.memory_encoder.encoder, model.decoder.model
    assert torch.equal(encoder.embed_tokens.weight, decoder.embed_tokens.weight[:496])
    assert torch.equal(encoder.layers[1].mlp.up_proj.weight, decoder.layers[1].mlp.up_proj.weight)
    assert isinstance(model.memory_projection, torch.nn.Identity)  # same width: no projection
    # the plain tiny pair's encoder is independent of the decoder
    plain = build_pair("tiny", checkpoint_root=tmp_path)
    assert not torch.equal(plain.memory_encoder.encoder.embed_tokens.weight,
                           plain.decoder.model.embed_tokens.weight[:496])


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_random_init_builds_the_random_checkpoints_weights_in_memory(checkpoint_root, name):
    """random_init (no checkpoint I/O, e.g. a real pair on a GPU for throughput) initialises as the model classes
    do: from the same seed, the very weights the tiny pairs' written checkpoints hold. tiny-moe shares tiny's
    encoder directory: the encoder draws from its own seeded stream, so whichever pair wrote it, it is the same.
    The GCA blocks and the projection are not in the checkpoints: they draw from the caller's random stream."""
    loaded = build_pair(name, checkpoint_root=checkpoint_root).state_dict()
    built = build_pair(name, random_init=True, dtype=torch.bfloat16)
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}
    assert built.decoder.config._attn_implementation == "sdpa"
    built = build_pair(name, random_init=True).state_dict()
    assert built.keys() == loaded.keys()
    assert [k for k in loaded if not is_added_parameter(k) and not torch.equal(built[k], loaded[k])] == []


def test_docs_fusion_parameter_table_is_generated():
    """docs/pairs.md's added parameters per fusion are what the meta-device pairs count."""
    pairs = (Path(__file__).resolve().parents[2] / "docs" / "pairs.md").read_text()
    assert fusion_parameter_table() in pairs
