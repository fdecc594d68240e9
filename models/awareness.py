"""AwarenessModel: a pretrained Qwen3 / Qwen3-MoE decoder that reads an encoder memory through GCA blocks."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.modeling_outputs import ModelOutput

from models.fusion import CrossReadingLayer, FusedCrossAttention, adopt_merged_attention, check_fusion
from models.gca import (AnswerSoFar, ChunkRouting, GatedCrossAttention, GCAMemory, MemoryPadding, MemoryReadingLayer,
                        chunk_mask, chunk_summary_states)
from models.lexical import NO_TOKEN, packed_question_prior, question_mask_of, question_prior
from models.loading import load_decoder, load_encoder
from models.loss import causal_lm_loss
from models.memory import EncoderAttention, MemoryEncoder, _check_vocabulary
from models.partitioning import UNPARTITIONED, Partitioner
from models.placement import resolve_gca_layers
from models.reading import MemoryReading
from models.specs import CONFIG_NAME, WEIGHTS_NAME
from models.trainable import (LoraPlan, TrainMode, apply_lora, is_added_parameter, merged_state_dict, set_trainable,
                              trainable_modes)



@dataclass
class AwarenessConfig:
    """How the model was built: the base checkpoints and what was added on top of them. The config file
    `save_pretrained` writes holds this plus the LoRA plan and train modes read off the modules at save time
    (`load_training` reads those back); the live config never holds them, so they cannot go stale."""

    decoder: str  # base decoder checkpoint directory (relative paths are relative to the saved directory)
    encoder: str  # base encoder checkpoint directory
    gca_layers: list[int]
    encoder_attention: str = "causal"
    gca_mlp: bool = False
    fusion: str = "gca"  # gca | cross | merged (models/fusion.py); files from before the field read as gca
    reading: MemoryReading = field(default_factory=MemoryReading)  # chunk routing and the length-aware scale
    format_version: int = 2  # 2: the reading options nested under "reading"; 1: flat memory_* keys

    def save(self, directory: Path, *, lora: LoraPlan | None, trainable: dict[str, TrainMode]) -> None:
        data = asdict(self) | {"lora": lora.to_dict() if lora else None, "trainable": trainable}
        (directory / CONFIG_NAME).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> "AwarenessConfig":
        """The config a directory was saved with; files of format 1 hold the reading options as flat memory_* keys."""
        data = _read_config(directory)
        reading = MemoryReading(**data["reading"]) if "reading" in data else MemoryReading.from_names(data)
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data} | {"reading": reading,
                                                                                         "format_version": 2})

    @staticmethod
    def load_training(directory: Path) -> tuple[LoraPlan | None, dict[str, TrainMode]]:
        """The LoRA plan (None without adapters) and train modes a saved model had."""
        data = _read_config(directory)
        return (LoraPlan.from_dict(data["lora"]) if data["lora"] else None), data["trainable"]


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} holds no {CONFIG_NAME}: pass a directory written by AwarenessModel.save_pretrained"
        )
    return json.loads(path.read_text())


@dataclass
class AwarenessOutput(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: Any = None
    gca_memory: GCAMemory | None = None
    aux_loss: torch.Tensor | None = None  # the MoE router's load-balancing loss, when the decoder reports it
    routing_loss: torch.Tensor | None = None  # chunk routing's loss (mean over layers), in training; in `loss` weighted


class AwarenessModel(nn.Module):
    """Decoder + memory encoder + GCA blocks in `gca_layers` + a projection shared by all blocks.

    Built from modules (see `from_pretrained_pair` and `models.pairs.build_pair` for the builders). At
    construction the gates are 0, so the model computes exactly what the pretrained decoder computes, and only
    the GCA blocks and the projection are trainable (`models.trainable.set_trainable` changes that). Under a
    `partitioner` (ZeRO-3) the blocks and the projection are created partitioned, like the pair they join.
    `fusion` chooses how the decoder reads the memory (models/fusion.py): `gca` (blocks in `gca_layers`), `cross`
    (a cross-attention in every layer, o_proj at 0, trained as the GCA group) or `merged` (every layer's own
    attention reads it too); for the last two `gca_layers` is every layer.
    `reading` (models/reading.py; gca and cross) with top_k > 0 routes each query to its top-k memory chunks and adds
    a router to every memory-reading block, trained by the routing loss (weight `reading.routing_loss`, added to
    `loss` in training); logn_scale = n_train > 0 scales queries by max(1, log n / log n_train) (models/gca.py). A
    built model may read otherwise for evaluation (`model.reading = replace(model.reading, top_k=8)`; k > 0 needs a
    model built with routers); what is saved is what it was built with (`model.config.reading`).
    """

    def __init__(
        self,
        decoder: nn.Module,
        memory_encoder: MemoryEncoder,
        gca_layers: str | list[int] = "upper_third",
        *,
        gca_mlp: bool = False,
        fusion: str = "gca",
        reading: MemoryReading = MemoryReading(),
        config: AwarenessConfig | None = None,
        partitioner: Partitioner = UNPARTITIONED,
    ):
        super().__init__()
        dcfg = decoder.config
        self.decoder = decoder
        self.memory_encoder = memory_encoder
        self.fusion = check_fusion(fusion)
        if fusion != "gca" and gca_mlp:
            raise ValueError(f"gca_mlp adds a gated MLP to GCA blocks; fusion={fusion!r} has none: set gca_mlp=False")
        reading.check(fusion)
        # Training only (not saved: reading is the same either way): the routing loss also trains what the chunk
        # summaries are made of (the memory projection and, where it trains, the encoder), so the encoder learns to
        # pack a chunk's keys into its last token for its router.
        self.routing_trains_summaries = False
        every_layer = list(range(dcfg.num_hidden_layers))
        self.gca_layers = resolve_gca_layers(gca_layers, dcfg.num_hidden_layers) if fusion == "gca" else every_layer
        self.config = config or AwarenessConfig(
            decoder=str(getattr(dcfg, "_name_or_path", "")),
            encoder=str(getattr(memory_encoder.encoder.config, "_name_or_path", "")),
            gca_layers=self.gca_layers,
            encoder_attention=memory_encoder.attention,
            gca_mlp=gca_mlp,
            fusion=fusion,
        )
        self.config.gca_layers, self.config.fusion, self.config.reading = self.gca_layers, fusion, reading
        self._reading = reading  # how it reads now: the config keeps how it was built (what is saved)
        weight = decoder.get_input_embeddings().weight
        with partitioner.creating(), torch.device(weight.device):
            self.memory_projection = (
                nn.Linear(memory_encoder.hidden_size, dcfg.hidden_size, bias=False)
                if memory_encoder.hidden_size != dcfg.hidden_size
                else nn.Identity()
            )
            if fusion == "gca":
                blocks = {i: _build_gca(dcfg, gca_mlp, router=reading.routes, lexical_gate=reading.lexical_gate,
                                        lexical_tokens=reading.lexical_tokens) for i in self.gca_layers}
            elif fusion == "cross":
                blocks = {i: FusedCrossAttention(dcfg, i, router=reading.routes) for i in self.gca_layers}
            else:
                blocks = {}
        self._init_added(list(blocks.values()), std=getattr(dcfg, "initializer_range", 0.02), partitioner=partitioner,
                         zero_output=fusion == "cross")
        # a no-op under a partitioner, which creates every parameter in the engine's precision, as the pair's
        self.memory_projection.to(weight.dtype)
        layers = decoder.model.layers
        wrapper = MemoryReadingLayer if fusion == "gca" else CrossReadingLayer
        for i, block in blocks.items():
            layers[i] = wrapper(layers[i], block.to(weight.dtype), i)
        if fusion == "merged":
            for layer in layers:
                adopt_merged_attention(layer.self_attn)
        set_trainable(self)
        # every decoder forward, generate's steps included, passes through the decoder's model with its input ids
        decoder.model.register_forward_pre_hook(self._hold_tokens, with_kwargs=True)

    # ----------------------------------------------------------------------------------------------- building
    @classmethod
    def from_pretrained_pair(
        cls,
        decoder: str | Path,
        encoder: str | Path,
        *,
        gca_layers: str | list[int] = "upper_third",
        encoder_attention: EncoderAttention = "causal",
        gca_mlp: bool = False,
        fusion: str = "gca",
        reading: MemoryReading = MemoryReading(),
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        partitioner: Partitioner = UNPARTITIONED,
        quantize: str = "none",
    ) -> "AwarenessModel":
        """Loads both base checkpoints through transformers' own classes and adds GCA blocks at 0.

        With a `partitioner` (ZeRO-3) the caller also has transformers' DeepSpeed integration on, so
        `from_pretrained` builds each checkpoint inside zero.Init and loads its shards into the partitions; the
        blocks and the projection are then created partitioned too. `quantize` nf4 | int8 loads both bases' linears
        in that many bits (models.quantization); what is added is created in full precision beside them."""
        loading = dict(dtype=dtype, device=device, quantize=quantize)
        memory_encoder = MemoryEncoder(load_encoder(encoder, **loading), attention=encoder_attention)
        base = load_decoder(decoder, **loading)
        config = AwarenessConfig(
            decoder=str(Path(decoder).expanduser().resolve()),
            encoder=str(Path(encoder).expanduser().resolve()),
            gca_layers=resolve_gca_layers(gca_layers, base.config.num_hidden_layers),
            encoder_attention=encoder_attention,
            gca_mlp=gca_mlp,
            fusion=fusion,
            reading=reading,
        )
        return cls(base, memory_encoder, config.gca_layers, gca_mlp=gca_mlp, fusion=fusion, reading=reading,
                   config=config, partitioner=partitioner)

    @staticmethod
    def _init_added(blocks: list[nn.Module], std: float, partitioner: Partitioner = UNPARTITIONED,
                    zero_output: bool = False) -> None:
        """Normal(0, std) projections, zero biases; with `zero_output` (fusion cross) o_proj at 0 instead, so the
        untrained block changes nothing; a lexical gate at 0 (it passes the whole prior until trained). One nn.Linear
        gathered at a time when partitioned."""
        for module in blocks:
            for sub in module.modules():
                if isinstance(sub, nn.Linear) and sub.weight.device.type != "meta":
                    zero = (zero_output and sub is module.o_proj) or sub is getattr(module, "lexical_gate", None)
                    with partitioner.gathered(list(sub.parameters(recurse=False))):
                        nn.init.normal_(sub.weight, std=0.0 if zero else std)
                        if sub.bias is not None:
                            nn.init.zeros_(sub.bias)

    # -------------------------------------------------------------------------------------------- inspection
    @property
    def reading(self) -> MemoryReading:
        """How the model reads its memory now (chunk routing, the length-aware scale)."""
        return self._reading

    @reading.setter
    def reading(self, reading: MemoryReading) -> None:
        reading.check(self.fusion)
        if reading.routes and not self.has_routers:
            raise ValueError(f"memory_top_k {reading.top_k}: routing needs the routers of a model built with "
                             f"memory_top_k > 0 (build_pair(..., reading=MemoryReading(top_k=K)), --model.memory_top_k "
                             f"K); 0 reads the whole memory")
        if reading.lexical_gate and not any(getattr(reader, "lexical_gate", None) is not None
                                            for reader in self.memory_readers().values()):
            raise ValueError("memory_lexical_gate: this model was built without lexical gates; build it with "
                             "MemoryReading(lexical_gate=True) (--model.memory_lexical_gate true) to train them")
        if reading.lexical_gate and reading.lexical_tokens and any(
                reader.lexical_gate.out_features != 2 for reader in self.memory_readers().values()):
            raise ValueError("memory_lexical_tokens with memory_lexical_gate: this model's gates were built for the "
                             "question's prior alone; build it with both (--model.memory_lexical_tokens true "
                             "--model.memory_lexical_gate true) to train the token prior's gate")
        self._reading = reading

    @property
    def has_routers(self) -> bool:
        """The memory-reading blocks have chunk routers (the model was built with top_k > 0)."""
        return any(getattr(reader, "router", None) is not None for reader in self.memory_readers().values())

    def gca_blocks(self) -> dict[int, GatedCrossAttention]:
        """The gated blocks by layer; none unless fusion is gca (gates, probes and plots are GCA's)."""
        if self.fusion != "gca":
            return {}
        return {i: self.decoder.model.layers[i].cross_attention for i in self.gca_layers}

    def memory_readers(self) -> dict[int, nn.Module]:
        """Per memory-reading layer, the module whose `project_memory` makes that layer's keys/values: the GCA
        block, the added cross-attention, or (merged) the layer's own attention."""
        layers = self.decoder.model.layers
        if self.fusion == "merged":
            return {i: layers[i].self_attn for i in self.gca_layers}
        return {i: layers[i].cross_attention for i in self.gca_layers}

    @torch.no_grad()
    def set_gates(self, value: float, *, partitioner: Partitioner = UNPARTITIONED) -> None:
        """Every GCA block's attention gate (and MLP gate, if any) to `value`. Gates at 0 leave the decoder exactly
        as it was; a small open gate avoids the closed gate's saddle (at 0 the gate and the block's weights get
        gradients only through each other) where there is no pretrained behaviour to protect, e.g. random pairs."""
        for block in self.gca_blocks().values():
            gates = [block.gate] + ([block.mlp_gate] if getattr(block, "mlp_gate", None) is not None else [])
            with partitioner.gathered(gates):
                for gate in gates:
                    gate.fill_(value)

    def gate_values(self) -> dict[int, float]:
        """|tanh(gate)| of each GCA layer's attention: how much each layer reads the memory."""
        return {i: float(block.gate.detach().float().tanh().abs()) for i, block in self.gca_blocks().items()}

    @property
    def device(self) -> torch.device:
        return self.decoder.get_input_embeddings().weight.device

    # ----------------------------------------------------------------------------------------------- memory
    def encode_memory(self, memory_input_ids: torch.Tensor, memory_attention_mask: torch.Tensor | None = None):
        """Encoder states (B, C*L, H_enc) and mask (B, C*L): what a memory store keeps and passes back as
        `memory_states` (before the trained projection, so a frozen encoder's store stays valid while GCA trains)."""
        return self.memory_encoder(memory_input_ids, memory_attention_mask)

    def prepare_memory(
        self,
        memory_input_ids: torch.Tensor | None = None,
        memory_attention_mask: torch.Tensor | None = None,
        memory_states: torch.Tensor | None = None,
        memory_states_mask: torch.Tensor | None = None,
        *,
        segment_ids: torch.Tensor | None = None,
        memory_segment_ids: torch.Tensor | None = None,
        memory_chunk_ids: torch.Tensor | None = None,
    ) -> GCAMemory | None:
        """Encodes (or takes) the memory, projects it once, and computes every GCA layer's keys and values once.

        Packed rows (several examples in one decoder row) pass `segment_ids` (B, T), the example each token belongs
        to, and `memory_segment_ids` (B, C) per chunk (or (B, M) per memory position): a token then reads only its
        own example's chunks. Ids < 0 mark padding.

        The chunk length (routing needs it) comes with the memory: memory_input_ids (B, C, L), or memory_states
        (B, C, L, H_enc) with memory_states_mask (B, C, L) (`MemoryStore.memory(chunked=True)`); flat memory_states
        (B, M, H_enc) have none, which only full attention accepts. Lexical routing also reads the chunks' token
        ids: memory_input_ids have them; chunked memory_states take them as `memory_chunk_ids` (B, C, L)
        (`MemoryStore.token_ids`)."""
        if memory_input_ids is not None and memory_states is not None:
            raise ValueError("pass either memory_input_ids or memory_states, not both")
        if memory_input_ids is None and memory_states is None:
            return None
        if memory_input_ids is not None:
            chunk_len = memory_input_ids.shape[-1]
            states, mask = self.memory_encoder(memory_input_ids, memory_attention_mask)
        else:
            chunk_len = memory_states.shape[2] if memory_states.dim() == 4 else None
            states, mask = self._check_memory_states(memory_states, memory_states_mask)
        projected = self.memory_projection(states.to(self.memory_projection_dtype))  # (B, M, H_dec)
        if (segment_ids is None) != (memory_segment_ids is None):
            raise ValueError("packed rows need both segment_ids (per token) and memory_segment_ids (per chunk)")
        if segment_ids is None:
            padding = MemoryPadding.from_mask(mask)
        else:
            padding = MemoryPadding.packed(mask, _per_memory_position(memory_segment_ids, mask), segment_ids)
        readers = self.memory_readers()
        layers = {i: reader.project_memory(projected, padding) for i, reader in readers.items()}
        for kv in layers.values():
            kv.logn_base = self.reading.logn_scale
        if self.reading.routes:
            self._route(layers, readers, projected, mask, padding, chunk_len)
        chunk_ids = None
        if memory_input_ids is not None and memory_input_ids.dim() == 3:  # the question's lexical prior compares them
            chunk_ids = (memory_input_ids, mask.view(memory_input_ids.shape))
        elif memory_chunk_ids is not None:
            if memory_states.dim() != 4 or memory_chunk_ids.shape != memory_states.shape[:3]:
                raise ValueError(f"memory_chunk_ids {tuple(memory_chunk_ids.shape)} must be (batch, chunks, chunk_len) "
                                 f"of chunked memory_states {tuple(memory_states.shape)}")
            chunk_ids = (memory_chunk_ids, mask.view(memory_chunk_ids.shape))
        return GCAMemory(layers=layers, states=projected, mask=mask, chunk_len=chunk_len, chunk_ids=chunk_ids)

    def _question_pending(self, gca_memory: GCAMemory | None) -> bool:
        """Lexical routing over a routed memory that holds no question prior yet (with_question adds one)."""
        if gca_memory is None or not self.reading.lexical_routing or not self.reading.routes:
            return False
        routed = [kv.routing for kv in gca_memory.layers.values() if kv.routing is not None]
        return bool(routed) and routed[0].prior is None

    def _hold_tokens(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook of the decoder's model: with memory_lexical_tokens, the memory's token prior for this
        forward's input ids (GCAMemory.hold_tokens); without, none left from an earlier forward."""
        memory = kwargs.get("gca_memory")
        if memory is None:
            return
        if not (self.reading.lexical_tokens and self.reading.routes):
            memory.hold_tokens(None, 0.0)
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError("memory_lexical_tokens reads each token's id: pass input_ids, not inputs_embeds")
        memory.hold_tokens(input_ids, self.lexical_weight(), self.token_window(), self.reading.lexical_window_carry)

    def _place_in_answer(self, gca_memory: GCAMemory, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                         labels: torch.Tensor | None, asking: bool) -> None:
        """memory_lexical_window: which of this forward's tokens answer (GCAMemory.answer). With labels, the labelled
        ones on; the first call over a memory without them, none (the question, whether this call or with_question
        gave the memory its prior); a later call without them (a cached decoding step), all of them, continuing the
        answer the memory's earlier calls fed."""
        if labels is not None or asking or gca_memory.answer_tail is None:
            fed = ~question_mask_of(input_ids, attention_mask, labels) if labels is not None else \
                torch.zeros_like(input_ids, dtype=torch.bool)
            gca_memory.answer = AnswerSoFar(fed=fed)
        else:
            gca_memory.answer = AnswerSoFar(fed=torch.ones_like(input_ids, dtype=torch.bool),
                                            before=gca_memory.answer_tail)
        earlier = gca_memory.answer.before if gca_memory.answer.before is not None else input_ids[:, :0]
        fed_tokens = input_ids.masked_fill(~gca_memory.answer.fed, NO_TOKEN)
        gca_memory.answer_tail = torch.cat([earlier, fed_tokens], dim=1)[:, -(self.token_window() - 1):]

    def token_window(self) -> int:
        """The token prior's window now: reading.lexical_window in training, reading.lexical_reading_window (when
        set) in eval mode."""
        return self.reading.token_window(self.training)

    def lexical_weight(self) -> float:
        """The question prior's weight now: reading.lexical_routing in training, reading.lexical_reading (when set)
        in eval mode."""
        return self.reading.lexical_weight(self.training)

    def with_question(self, gca_memory: GCAMemory | None, input_ids: torch.Tensor, question_mask: torch.Tensor, *,
                      segment_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                      memory_segment_ids: torch.Tensor | None = None) -> GCAMemory | None:
        """With `memory_lexical_routing`: the memory again, each routing layer holding the prior of these rows'
        questions (models/lexical.py), computed once per question, before decoding; the memory given is left as it
        was, so one prepared memory (a served memory's K/V) serves every question. Rows (B, T) fold onto the
        memory's B_mem rows as the GCA blocks fold them (row i reads memory i // (B / B_mem)); packed rows
        (`segment_ids`, with `labels` and `memory_segment_ids`) get each example's own prior."""
        if gca_memory is None or not self.reading.lexical_routing or not self.reading.routes:
            return gca_memory
        if gca_memory.chunk_ids is None:
            raise ValueError("memory_lexical_routing compares the question's tokens with the memory's, and this memory "
                             "came without them: pass memory_input_ids (B, C, L), or chunked memory_states with "
                             "memory_chunk_ids (MemoryStore.token_ids)")
        ids, token_mask = gca_memory.chunk_ids
        if segment_ids is not None:
            per_chunk = memory_segment_ids
            if per_chunk.shape[1] != ids.shape[1]:  # one id per memory position: each chunk's first
                per_chunk = per_chunk.view(ids.shape[0], ids.shape[1], -1)[..., 0]
            prior = packed_question_prior(input_ids, segment_ids, labels, ids, token_mask, per_chunk)  # (B, T, C)
        else:
            b_mem = ids.shape[0]
            if input_ids.shape[0] % b_mem:
                raise ValueError(f"decoder batch {input_ids.shape[0]} is not a multiple of the memory batch {b_mem}")
            rows = input_ids.shape[0] // b_mem
            prior = question_prior(input_ids.view(b_mem, rows, -1), question_mask.view(b_mem, rows, -1).bool(), ids,
                                   token_mask)  # (B_mem, R, C)
        weight = self.lexical_weight()
        layers = {i: kv if kv.routing is None else replace(kv, routing=replace(kv.routing, prior=weight * prior))
                  for i, kv in gca_memory.layers.items()}
        return replace(gca_memory, layers=layers)

    def _route(self, layers, readers, projected: torch.Tensor, mask: torch.Tensor, padding: MemoryPadding,
               chunk_len: int | None) -> None:
        """Each layer's chunk routing: its router's summary keys of the chunks' last real tokens, which chunks each
        query may read, and whether to compute the loss. The summarised states are detached unless
        `routing_trains_summaries`: the routing loss then trains the routers alone."""
        if chunk_len is None:
            raise ValueError("memory_top_k routes over chunks, and flat memory_states (B, M, H_enc) do not say where "
                             "chunks end: pass them as (B, C, L, H_enc) with a (B, C, L) mask "
                             "(MemoryStore.memory(chunked=True)), or memory_input_ids (B, C, L)")
        summaries = self.reading.summaries
        if chunk_len % summaries:
            raise ValueError(f"memory_summaries ({summaries}) must divide the memory's chunk length ({chunk_len}): "
                             f"each summary key stands for a block of chunk_len / memory_summaries tokens")
        block = chunk_len // summaries
        source = projected if self.routing_trains_summaries else projected.detach()
        summary_states = chunk_summary_states(source, mask, block)  # (B, C * S, H_dec)
        readable = chunk_mask(padding, chunk_len)  # (B, 1, 1 or T, C) or None
        blocks = chunk_mask(padding, block) if summaries > 1 else None  # (B, 1, 1 or T, C * S) or None
        train = self.training and self.reading.routing_loss > 0 and torch.is_grad_enabled()
        for i, kv in layers.items():
            kv.routing = ChunkRouting(summary=readers[i].router(summary_states), chunk_len=chunk_len,
                                      top_k=self.reading.top_k, chunk_mask=readable, train=train,
                                      summaries=summaries, summary_mask=blocks, weights=self.reading.chunk_weights)

    @property
    def memory_projection_dtype(self) -> torch.dtype:
        return self.decoder.get_input_embeddings().weight.dtype

    def _check_memory_states(self, states: torch.Tensor, mask: torch.Tensor | None):
        if states.dim() not in (3, 4) or states.shape[-1] != self.memory_encoder.hidden_size:
            raise ValueError(
                f"memory_states must be (batch, memory_len, {self.memory_encoder.hidden_size}) encoder states as "
                f"returned by encode_memory, or (batch, chunks, chunk_len, {self.memory_encoder.hidden_size}), got "
                f"shape {tuple(states.shape)}"
            )
        if states.dim() == 4:  # chunked: flattened as the encoder flattens (B, C, L) chunks
            if mask is not None and mask.shape != states.shape[:3]:
                raise ValueError(f"memory_states_mask must be (batch, chunks, chunk_len) = {tuple(states.shape[:3])} "
                                 f"for chunked memory_states, got {tuple(mask.shape)}")
            states = states.flatten(1, 2)
            mask = mask.flatten(1, 2) if mask is not None else None
        if mask is None:
            mask = torch.ones(states.shape[:2], dtype=torch.bool, device=states.device)
        mask = mask.bool()
        return states.masked_fill(~mask[..., None], 0.0), mask

    # ---------------------------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        memory_input_ids: torch.Tensor | None = None,
        memory_attention_mask: torch.Tensor | None = None,
        memory_states: torch.Tensor | None = None,
        memory_states_mask: torch.Tensor | None = None,
        gca_memory: GCAMemory | None = None,
        labels: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        memory_segment_ids: torch.Tensor | None = None,
        memory_chunk_ids: torch.Tensor | None = None,
        **decoder_kwargs: Any,
    ) -> AwarenessOutput:
        """Like Qwen3ForCausalLM.forward, plus the memory; `gca_memory` reuses memory prepared earlier.

        Packed rows: `position_ids` restarting at 0 for each example (transformers then keeps self-attention inside
        each example) with `segment_ids` / `memory_segment_ids` (see prepare_memory) for the memory."""
        if input_ids is not None:
            _check_vocabulary(input_ids, self.decoder.config.vocab_size, "input_ids", "decoder")
        if segment_ids is not None and (attention_mask is not None or decoder_kwargs.get("position_ids") is None):
            raise ValueError("packed rows take position_ids restarting per example and no attention_mask")
        if segment_ids is not None:
            # transformers detects packed rows from position_ids only without a cache
            if decoder_kwargs.get("use_cache"):
                raise ValueError("packed rows are a training format: pass use_cache=False (or leave it unset)")
            decoder_kwargs["use_cache"] = False
        if gca_memory is None:
            gca_memory = self.prepare_memory(memory_input_ids, memory_attention_mask, memory_states, memory_states_mask,
                                             segment_ids=segment_ids, memory_segment_ids=memory_segment_ids,
                                             memory_chunk_ids=memory_chunk_ids)
        asking = self._question_pending(gca_memory)
        if asking:  # the first call over a memory holds its question
            if input_ids is None:
                raise ValueError("memory_lexical_routing reads the question's token ids: pass input_ids")
            # packed rows: each token gets its own example's question prior
            gca_memory = self.with_question(gca_memory, input_ids, question_mask_of(input_ids, attention_mask, labels),
                                            segment_ids=segment_ids, labels=labels,
                                            memory_segment_ids=memory_segment_ids)
        if self.token_window() > 1 and gca_memory is not None and input_ids is not None:
            self._place_in_answer(gca_memory, input_ids, attention_mask, labels, asking)
        if labels is not None and self.training and not _reports_router_logits(self.decoder):
            # training: the loss without the (B, T, V) logits (models/loss.py); the model returns none
            decoder_kwargs.setdefault("use_cache", False)  # a training forward decodes nothing after it
            hidden = self.decoder.model(input_ids=input_ids, attention_mask=attention_mask, gca_memory=gca_memory,
                                        **decoder_kwargs).last_hidden_state  # (B, T, H)
            out = AwarenessOutput(loss=causal_lm_loss(hidden, self.decoder.get_output_embeddings(), labels))
        else:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                               gca_memory=gca_memory, **decoder_kwargs)
        loss, routing_loss = out.loss, _routing_loss(gca_memory)
        if loss is not None and routing_loss is not None:
            loss = loss + self.reading.routing_loss * routing_loss
        return AwarenessOutput(
            loss=loss,
            logits=out.logits,
            cache=out.cache,
            gca_memory=gca_memory,
            aux_loss=getattr(out, "aux_loss", None),
            routing_loss=routing_loss,
        )

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        memory_input_ids: torch.Tensor | None = None,
        memory_attention_mask: torch.Tensor | None = None,
        memory_states: torch.Tensor | None = None,
        memory_states_mask: torch.Tensor | None = None,
        gca_memory: GCAMemory | None = None,
        memory_chunk_ids: torch.Tensor | None = None,
        **generate_kwargs: Any,
    ) -> torch.Tensor:
        """transformers' generate (greedy, sampling, beam search) on the decoder, with the memory's keys/values
        computed once here; expanded rows (beams, num_return_sequences) read their own row's memory."""
        _check_vocabulary(input_ids, self.decoder.config.vocab_size, "input_ids", "decoder")
        if gca_memory is None:
            gca_memory = self.prepare_memory(memory_input_ids, memory_attention_mask, memory_states, memory_states_mask,
                                             memory_chunk_ids=memory_chunk_ids)
        if gca_memory is not None and gca_memory.batch_size != input_ids.shape[0]:
            raise ValueError(f"memory batch {gca_memory.batch_size} differs from the prompt batch {input_ids.shape[0]}")
        if self._question_pending(gca_memory):  # the prompt is the question: its prior holds for every generated token
            gca_memory = self.with_question(gca_memory, input_ids, question_mask_of(input_ids, attention_mask, None))
        if gca_memory is not None and self.token_window() > 1:  # the answer starts after the prompt
            gca_memory = replace(gca_memory, answer=None, answer_tail=None, answer_start=input_ids.shape[1])
        with allowing_memory_keyword(self.decoder):
            return self.decoder.generate(
                input_ids=input_ids, attention_mask=attention_mask, gca_memory=gca_memory, **generate_kwargs
            )

    def gradient_checkpointing_enable(self) -> None:
        """Checkpoints every decoder layer, GCA block and encoder layer, in training mode (transformers checkpoints a
        layer only while it trains). Non-reentrant (the memory is a keyword), so no input needs requires_grad:
        transformers' hook that sets it on the embeddings' output is removed, else a frozen encoder's whole forward
        would be kept for a backward that updates nothing in it (proto1 ran out of an H100's 80 GiB so)."""
        kwargs = {"use_reentrant": False}
        for model in (self.decoder, self.memory_encoder.encoder):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            model.disable_input_require_grads()

    def compile_layers(self, **options: Any) -> None:
        """Regional torch.compile: every decoder layer (with its GCA block) and every encoder layer compiled in place.
        Layers of one kind share their code, so each kind compiles once and its graph serves all of them; compiling
        the whole model instead would trace every layer and the memory preparation into one long graph.
        `options` go to nn.Module.compile (e.g. `fullgraph=True`, `backend=...`)."""
        for layer in (*self.decoder.model.layers, *self.memory_encoder.encoder.layers):
            layer.compile(**options)

    # ------------------------------------------------------------------------------------------- save / load
    def save_pretrained(self, directory: str | Path, *, merged: bool = False) -> Path:
        """Writes what training changed (GCA blocks, projection, LoRA adapters, and any base weight trained in
        full) as safetensors, plus a config naming the base checkpoints. `merged=True` instead writes a standalone
        directory: the decoder and encoder with LoRA merged in, as plain transformers checkpoints, beside the GCA
        weights."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = replace(self.config)
        if merged:
            decoder, encoder = self.decoder, self.memory_encoder.encoder
            decoder.save_pretrained(directory / "decoder", state_dict=merged_state_dict(decoder, base_only=True))
            encoder.save_pretrained(directory / "encoder", state_dict=merged_state_dict(encoder, base_only=True))
            config.decoder, config.encoder = "decoder", "encoder"
            lora, trainable = None, {"decoder": "frozen", "encoder": "frozen", "gca": "full"}
            state = merged_state_dict(self, base_only=False)
        else:
            lora, trainable = LoraPlan.of(self), trainable_modes(self)
            state = {n: p for n, p in self.named_parameters() if is_added_parameter(n) or p.requires_grad}
        save_file({n: p.detach().contiguous().cpu() for n, p in state.items()}, str(directory / WEIGHTS_NAME))
        config.save(directory, lora=lora, trainable=trainable)
        return directory

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        *,
        decoder: str | Path | None = None,
        encoder: str | Path | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device = "cpu",
        quantize: str = "none",
    ) -> "AwarenessModel":
        """Rebuilds the model from its base checkpoints (override their paths with `decoder=`/`encoder=` when they
        moved) and loads the saved weights over them. `quantize` nf4 | int8 reloads it onto a base in fewer bits,
        whichever base it trained on: the saved weights are only what training added."""
        directory = Path(directory)
        config = AwarenessConfig.load(directory)
        lora, trainable = AwarenessConfig.load_training(directory)
        trained_bases = [part for part in ("decoder", "encoder") if trainable.get(part) == "full"]
        if quantize != "none" and trained_bases:
            raise ValueError(f"{str(directory)!r} trained its {' and '.join(trained_bases)} in full: those weights are "
                             f"the export's own, which a {quantize} base cannot hold; load it with quantize none (a "
                             f"base in fewer bits serves exports whose base stayed frozen or trained through LoRA)")
        model = cls.from_pretrained_pair(
            decoder or _relative_to(directory, config.decoder),
            encoder or _relative_to(directory, config.encoder),
            gca_layers=config.gca_layers,
            encoder_attention=config.encoder_attention,  # type: ignore[arg-type]
            gca_mlp=config.gca_mlp,
            fusion=config.fusion,
            reading=config.reading,
            dtype=dtype,
            device=device,
            quantize=quantize,
        )
        if lora:
            apply_lora(model, lora)
        set_trainable(model, **trainable)
        model.config.decoder, model.config.encoder = config.decoder, config.encoder
        model.load_added_weights(directory / WEIGHTS_NAME)
        return model

    @torch.no_grad()
    def load_added_weights(self, path: str | Path, *, partitioner: Partitioner = UNPARTITIONED) -> None:
        """Loads a saved awareness.safetensors; every GCA/projection/LoRA weight must be in it. Partitioned, one
        parameter is gathered at a time (the file may hold base weights trained in full)."""
        state = load_file(str(path), device=str(self.device))
        params = dict(self.named_parameters())
        missing = sorted({n for n in params if is_added_parameter(n)} - state.keys())
        unexpected = sorted(state.keys() - params.keys())
        if unexpected or missing:
            raise ValueError(
                f"{path} does not fit this model: unexpected {unexpected[:5]}, missing {missing[:5]} "
                f"(was it saved with another fusion, other gca_layers, gca_mlp or LoRA settings?)"
            )
        for name, tensor in state.items():
            param = params[name]
            with partitioner.gathered([param]):
                if param.shape != tensor.shape:
                    raise ValueError(f"{path} does not fit this model: {name} is {tuple(tensor.shape)} there and "
                                     f"{tuple(param.shape)} here")
                param.copy_(tensor)


_KEYWORD_LOCK = threading.Lock()


@contextmanager
def allowing_memory_keyword(decoder: nn.Module):
    """While inside, the transformers `decoder`'s generate() takes the `gca_memory` keyword (a GCAMemory), which its
    own check of model kwargs refuses: forward() does not name it, as it reaches the layers through forward's **kwargs.
    The check is transformers' private `_validate_model_kwargs`, wrapped on the instance to skip that one keyword
    (tests/models/test_awareness.py pins it, so `make test-latest` sees a transformers that changes it). Threads may
    generate on one decoder at once (`mlflow models serve` answers concurrent requests in threads): the first to enter
    installs the skip, the last to leave removes it. Its `prepare_inputs_for_generation` is wrapped too, to tell a
    memory generated from (`answer_start` set: memory_lexical_window) where each step stands in the answer, from the
    rows generate holds (beam search reorders them)."""
    with _KEYWORD_LOCK:
        if not getattr(decoder, "_gca_generates", 0):
            validate = decoder._validate_model_kwargs

            def validate_without_memory(model_kwargs):
                model_kwargs.pop("gca_memory", None)
                return validate(model_kwargs)

            prepare = decoder.prepare_inputs_for_generation

            def prepare_following_the_answer(input_ids, *args, **kwargs):
                inputs = prepare(input_ids, *args, **kwargs)
                memory = inputs.get("gca_memory")
                if memory is not None and memory.answer_start is not None:
                    memory.follow_generation(input_ids, inputs["input_ids"].shape[1])
                return inputs

            decoder._validate_model_kwargs = validate_without_memory
            decoder.prepare_inputs_for_generation = prepare_following_the_answer
            decoder._gca_generates = 0
        decoder._gca_generates += 1
    try:
        yield
    finally:
        with _KEYWORD_LOCK:
            decoder._gca_generates -= 1
            if not decoder._gca_generates:
                del decoder._validate_model_kwargs, decoder.prepare_inputs_for_generation, decoder._gca_generates


def _reports_router_logits(decoder: nn.Module) -> bool:
    """A Qwen3-MoE decoder asked for its router logits adds their load-balancing loss in its own forward."""
    return bool(getattr(decoder.config, "output_router_logits", False))


def _routing_loss(gca_memory: GCAMemory | None) -> torch.Tensor | None:
    """The mean over layers of the routing losses this forward left in the memory (training with routing), or None."""
    losses = [kv.routing.loss for kv in (gca_memory.layers.values() if gca_memory is not None else ())
              if kv.routing is not None and kv.routing.train and kv.routing.loss is not None]
    return torch.stack(losses).mean() if losses else None


def _build_gca(dcfg, gca_mlp: bool, router: bool = False, lexical_gate: bool = False,
               lexical_tokens: bool = False) -> GatedCrossAttention:
    return GatedCrossAttention(
        hidden_size=dcfg.hidden_size,
        num_heads=dcfg.num_attention_heads,
        num_kv_heads=dcfg.num_key_value_heads,
        head_dim=getattr(dcfg, "head_dim", None) or dcfg.hidden_size // dcfg.num_attention_heads,
        rms_norm_eps=dcfg.rms_norm_eps,
        attention_bias=getattr(dcfg, "attention_bias", False),
        mlp_intermediate_size=dcfg.intermediate_size if gca_mlp else None,
        hidden_act=dcfg.hidden_act,
        router=router,
        lexical_gate=lexical_gate,
        lexical_tokens=lexical_tokens,
    )


def _relative_to(directory: Path, path: str) -> Path:
    candidate = Path(path).expanduser()
    return candidate if candidate.is_absolute() else directory / candidate


def _per_memory_position(memory_segment_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Chunk-level segment ids (B, C) -> one per memory position (B, C*L); position-level ids pass through."""
    if memory_segment_ids.shape == mask.shape:
        return memory_segment_ids
    b, c = memory_segment_ids.shape
    if mask.shape[1] % c:
        raise ValueError(f"memory_segment_ids {tuple(memory_segment_ids.shape)} match neither the chunks nor the "
                         f"positions of a memory of shape {tuple(mask.shape)}")
    return memory_segment_ids.repeat_interleave(mask.shape[1] // c, dim=1)
