"""Named decoder/encoder pairs: presets are data (architecture, checkpoint names, published sizes)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model, Qwen3MoeConfig, Qwen3MoeForCausalLM

from models.awareness import AwarenessModel
from models.fusion import FUSIONS
from models.memory import MemoryEncoder
from models.partitioning import UNPARTITIONED, Partitioner
from models.reading import MemoryReading
from models.specs import PAIRS, PairSpec, get_pair, truncated_pair

CHECKPOINT_ROOT_ENV = "AWARENESS_CHECKPOINT_ROOT"
RANDOM_WEIGHTS_MARKER = "awareness_random_weights.json"

def decoder_config(spec: PairSpec) -> Qwen3Config | Qwen3MoeConfig:
    fields = dict(spec.decoder_config)
    cls = Qwen3MoeConfig if fields.pop("model_type") == "qwen3_moe" else Qwen3Config
    return cls(**fields)


def encoder_config(spec: PairSpec) -> Qwen3Config:
    fields = dict(spec.encoder_config)
    fields.pop("model_type")
    return Qwen3Config(**fields)


def write_random_checkpoints(spec: PairSpec, root: str | Path, *, seed: int = 0,
                             dtype: torch.dtype | None = None,
                             device: str | torch.device = "cpu") -> tuple[Path, Path]:
    """Writes the pair's decoder and encoder with random weights as ordinary transformers checkpoints, in float32 or
    `dtype` (bfloat16: as Qwen publishes the real pairs, half the bytes; the GPU checks write proto1 so). A pair
    whose checkpoints are current (same architecture, seed and dtype) is not built at all: every worker of a run
    calls this through build_pair, and building the whole pair there would hold it in each worker's memory (ZeRO-3
    loading must not). `device` cuda draws the weights on the GPU: the 8B pairs' 16 billion draws take seconds there
    instead of minutes on the CPU (another random stream, so the device is part of the stamp)."""
    root = Path(root)
    decoder_dir, encoder_dir = root / spec.decoder, root / spec.encoder
    # Rewritten whenever the architecture, seed or dtype changed, so a cache never serves stale weights. Pairs that
    # share a decoder (tiny, tiny-shared) stamp it alike: only their encoders differ.
    written_as = ({} if dtype is None else {"dtype": str(dtype)}) | \
        ({} if torch.device(device).type == "cpu" else {"device": torch.device(device).type})
    stamps = {decoder_dir: json.dumps({"config": spec.decoder_config, "seed": seed, **written_as}, sort_keys=True),
              encoder_dir: json.dumps({"config": spec.encoder_config, "seed": seed,
                                       "from_decoder": spec.encoder_from_decoder, **written_as}, sort_keys=True)}
    if all(_stamped(directory, stamp) for directory, stamp in stamps.items()):
        return decoder_dir, encoder_dir
    dcfg = decoder_config(spec)
    decoder_cls = Qwen3MoeForCausalLM if isinstance(dcfg, Qwen3MoeConfig) else Qwen3ForCausalLM
    with torch.device(device):
        torch.manual_seed(seed)
        decoder = decoder_cls(dcfg)
        torch.manual_seed(seed + 1)  # the encoder's own stream: pairs sharing an encoder directory write the same one
        encoder = Qwen3Model(encoder_config(spec))
    if spec.encoder_from_decoder:
        _initialise_from(encoder, decoder.model)
    for directory, model in ((decoder_dir, decoder), (encoder_dir, encoder)):
        if not _stamped(directory, stamps[directory]):
            if dtype is not None:
                model.to(dtype)
            _save_by_moving_in(model, directory, stamps[directory])
    return decoder_dir, encoder_dir


def _save_by_moving_in(model: torch.nn.Module, directory: Path, stamp: str) -> None:
    """save_pretrained into a staging directory beside `directory`, then each file moved in (os.replace), the stamp
    last: a process loading the checkpoint meanwhile (every worker of a run, a test) gets each file whole, old or
    new, and one that has the old weights mapped keeps them."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory.parent, prefix=f".{directory.name}-") as staging:
        model.save_pretrained(staging)
        Path(staging, RANDOM_WEIGHTS_MARKER).write_text(stamp)
        for name in sorted(os.listdir(staging), key=lambda name: name == RANDOM_WEIGHTS_MARKER):
            os.replace(Path(staging, name), directory / name)


def _stamped(directory: Path, stamp: str) -> bool:
    marker = directory / RANDOM_WEIGHTS_MARKER
    return marker.is_file() and marker.read_text() == stamp


@torch.no_grad()
def _initialise_from(encoder: Qwen3Model, decoder: Qwen3Model) -> None:
    """The decoder's embedding rows (the encoder's vocabulary is a prefix), its first layers and its final norm."""
    encoder.embed_tokens.weight.copy_(decoder.embed_tokens.weight[: encoder.config.vocab_size])
    for encoder_layer, decoder_layer in zip(encoder.layers, decoder.layers, strict=False):
        encoder_layer.load_state_dict(decoder_layer.state_dict())
    encoder.norm.weight.copy_(decoder.norm.weight)


def pair_checkpoints(name: str, checkpoint_root: str | Path | None = None, *, seed: int = 0) -> tuple[Path, Path]:
    """The pair's decoder and encoder directories under `checkpoint_root` (or $AWARENESS_CHECKPOINT_ROOT); a tiny
    pair's random checkpoints are written there first (default root: ~/.cache/awareness)."""
    spec = get_pair(name)
    root = checkpoint_root or os.environ.get(CHECKPOINT_ROOT_ENV)
    if spec.random_weights:
        return write_random_checkpoints(spec, root or default_tiny_root(), seed=seed)
    if root is None:
        raise ValueError(
            f"pair {name!r} loads real weights: set {CHECKPOINT_ROOT_ENV} (or pass checkpoint_root=) to a directory "
            f"holding {spec.decoder}/ and {spec.encoder}/; device='meta' builds the architecture without weights"
        )
    return Path(root) / spec.decoder, Path(root) / spec.encoder


def default_tiny_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "awareness" / "random-checkpoints"


def build_pair(
    name: str,
    *,
    device: str | torch.device = "cpu",
    checkpoint_root: str | Path | None = None,
    gca_layers: str | list[int] = "upper_third",
    encoder_attention: str | None = None,
    gca_mlp: bool = False,
    fusion: str = "gca",
    reading: MemoryReading = MemoryReading(),
    dtype: torch.dtype | None = None,
    seed: int = 0,
    encoder_checkpoint: str | Path | None = None,
    random_init: bool = False,
    layers: int | None = None,
    partitioner: Partitioner = UNPARTITIONED,
    quantize: str = "none",
) -> AwarenessModel:
    """Builds a named pair.

    - device="meta": the real architecture without memory or weights (parameter counts, memory plans).
    - random_init=True: the real architecture with the model classes' own random initialisation (from `seed`),
      built directly on `device` in `dtype`; no checkpoint is read or written (throughput and memory measurements
      of real shapes, e.g. benchmarks/gpu_mfu.py).
    - otherwise the pair's checkpoints are loaded from `checkpoint_root` (or $AWARENESS_CHECKPOINT_ROOT), where
      they live as `<root>/Qwen3-8B`, `<root>/Qwen3-Embedding-8B`, ...; tiny pairs write random checkpoints
      there first (default root: ~/.cache/awareness), so they go through the same loading code as real ones.
    - encoder_checkpoint: a Qwen3 encoder directory replacing the pair's encoder, e.g. one extracted from a
      UL2-trained Qwen3ForSeq2SeqLM (`Qwen3EncoderModel.from_seq2seq(model).save_pretrained(dir)`); it was trained
      bidirectionally, so it is read bidirectionally unless encoder_attention says otherwise.
    - fusion: how the decoder reads the memory, gca | cross | merged (models/fusion.py).
    - reading: chunk routing and the length-aware scale (models/reading.py).
    - layers (meta or random_init only): the first `layers` decoder and encoder layers of the real widths, heads
      and experts (`truncated_pair`): the real shapes on a CPU, or the prod pair on one GPU.
    - partitioner (checkpoints only): the GCA blocks and the projection are created partitioned, for a caller that
      has transformers load the checkpoints into ZeRO-3 partitions (pipelines.train.engine.zero3_loading).
    - quantize (checkpoints only): nf4 | int8 loads the decoder's and encoder's linears through bitsandbytes
      (QLoRA, models/quantization.py); none keeps them as stored.
    """
    spec = get_pair(name) if layers is None else truncated_pair(name, layers)
    attention = encoder_attention or ("bidirectional" if encoder_checkpoint else spec.encoder_attention)
    if layers is not None and not (random_init or torch.device(device).type == "meta"):
        raise ValueError("layers truncates a pair built from its configs: pass random_init=True or device='meta'")
    if torch.device(device).type == "meta" or random_init:
        if partitioner is not UNPARTITIONED or quantize != "none":
            raise ValueError("a partitioner and quantize apply to pairs loaded from checkpoints, not to meta or "
                             "random_init")
        return _build_from_configs(spec, device=device, gca_layers=gca_layers, encoder_attention=attention,
                                   gca_mlp=gca_mlp, fusion=fusion, dtype=dtype, seed=seed, reading=reading)
    decoder_dir, encoder_dir = pair_checkpoints(name, checkpoint_root, seed=seed)
    if encoder_checkpoint is not None:
        encoder_dir = Path(encoder_checkpoint)
    return AwarenessModel.from_pretrained_pair(
        decoder_dir, encoder_dir, gca_layers=gca_layers, encoder_attention=attention,  # type: ignore[arg-type]
        gca_mlp=gca_mlp, fusion=fusion, reading=reading, dtype=dtype, device=device, partitioner=partitioner,
        quantize=quantize,
    )


def _build_from_configs(spec: PairSpec, *, device, gca_layers, encoder_attention, gca_mlp, fusion, dtype,
                        seed, reading: MemoryReading) -> AwarenessModel:
    """The pair from its configs on `device`: shapes only on meta, randomly initialised elsewhere."""
    dcfg = decoder_config(spec)
    decoder_cls = Qwen3MoeForCausalLM if isinstance(dcfg, Qwen3MoeConfig) else Qwen3ForCausalLM
    on_meta = torch.device(device).type == "meta"
    if not on_meta:
        torch.manual_seed(seed)
    with torch.device(device):  # parameters are created (and initialised) where they will live
        decoder = decoder_cls._from_config(dcfg, dtype=dtype, attn_implementation="sdpa")
        if not on_meta:
            torch.manual_seed(seed + 1)  # as write_random_checkpoints: the encoder's own stream
        encoder = Qwen3Model._from_config(encoder_config(spec), dtype=dtype, attn_implementation="sdpa")
    if spec.encoder_from_decoder and not on_meta:
        _initialise_from(encoder, decoder.model)
    return AwarenessModel(decoder, MemoryEncoder(encoder, attention=encoder_attention), gca_layers, gca_mlp=gca_mlp,
                          fusion=fusion, reading=reading)


def added_parameters(name: str, fusion: str) -> int:
    """What AwarenessModel adds to a pair with `fusion` (GCA blocks or cross-attention, and the projection), counted
    on the real architecture on the meta device (default placement); merged adds only the projection."""
    model = build_pair(name, device="meta", fusion=fusion)
    return sum(p.numel() for n, p in model.named_parameters() if ".cross_attention." in n
               or n.startswith("memory_projection."))


def fusion_parameter_table() -> str:
    """docs/pairs.md's table of added parameters per fusion, for every named pair."""
    lines = ["| pair | " + " | ".join(FUSIONS) + " |", "|---|" + "---:|" * len(FUSIONS)]
    for name in PAIRS:
        cells = [_short(added_parameters(name, fusion)) for fusion in FUSIONS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _short(count: int) -> str:
    if count >= 1e9:
        return f"{count / 1e9:.2f}B"
    if count >= 1e6:
        return f"{count / 1e6:.1f}M"
    return f"{count / 1e3:.1f}k" if count >= 1e3 else str(count)
