"""The dense retriever job's recipe (jobs/retriever.py): the pair's memory encoder trained contrastively to find each
needle question's evidence chunks among its memory's chunks and the batch's, the retriever the dense_rag baseline
reads with (pipelines.data.memory_modes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import deepspeed
import numpy as np
import torch
import torch.distributed as dist

from models.loading import load_encoder
from models.pairs import pair_checkpoints
from models.retriever import DenseRetriever, top_k
from pipelines.data.memory_modes import evidence_held
from pipelines.data.streams import QuestionChunkStream, training_memory
from pipelines.data.synthetic_needles import parse_mixture
from pipelines.evaluate.collectives import summed_over_ranks
from pipelines.tracking.tracker import Tracker
from pipelines.train.configs.retriever import RetrieverConfig
from pipelines.train.recipes import Loss, Prepared, TrainState, trainable_groups

GROUP = "encoder"  # the whole encoder trains, at the schedule's rate


class RetrieverRecipe:
    """Recipe (pipelines.train.recipes) for a DenseRetriever on the needle mixture's questions and evidence."""

    def parse(self, data: dict[str, Any]) -> RetrieverConfig:
        return RetrieverConfig.from_dict(data)

    def prepare(self, config: RetrieverConfig) -> Prepared:
        encoder = encoder_directory(config)
        return Prepared(config, worker={"encoder": encoder},
                        tags={"job": "retriever", "pair": config.model.pair, "base.encoder": encoder})

    def build_model(self, config: RetrieverConfig, worker: dict[str, Any], ds_config: dict[str, Any]) -> DenseRetriever:
        """Built whole on every worker and partitioned (ZeRO-3) by deepspeed.initialize: an encoder fits a device."""
        m = config.model
        return DenseRetriever(load_encoder(worker["encoder"], dtype=torch.float32), m.attention, m.temperature).train()

    def parameter_groups(self, model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
        return trainable_groups(model, lambda name: GROUP)

    def stream(self, config: RetrieverConfig, worker: dict[str, Any], rank: int, world: int, start_step: int):
        return QuestionChunkStream(config.needle.spec(), config.needle.seed,
                                   memories_per_step=config.train.memories_per_step,
                                   grad_accum=config.train.grad_accum, rank=rank, world=world)

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["query_mask"].sum() + batch["chunk_mask"].sum())

    def loss(self, engine, config: RetrieverConfig, batch: dict[str, torch.Tensor]) -> Loss:
        return Loss(engine(**{k: v.to(engine.device) for k, v in batch.items()}), {})

    def before_step(self, engine, config: RetrieverConfig, state: TrainState, stream) -> dict[str, float]:
        return {}

    def probe(self, engine, config: RetrieverConfig, state: TrainState, stream) -> dict[str, float]:
        return {}

    @torch.no_grad()
    def evaluate(self, engine, config: RetrieverConfig, rank: int, world: int) -> dict[str, float]:
        """recall_at_<k>/<variant> on held-out memories of the mixture at model.eval_multiplier x the base size: the
        share of questions whose every evidence chunk is among the k chunks of its memory the retriever ranks
        highest (what a reader given k chunks could answer from), and recall_at_<k> over all of them."""
        model, k = engine.module, config.model.k
        spec, names = config.needle.spec(), list(parse_mixture(config.needle.variants)[0])
        found, asked = np.zeros(len(names)), np.zeros(len(names))
        model.eval()
        for index in range(rank, config.needle.val_memories, world):
            memory = training_memory(spec, config.needle.seed + 1, index, config.model.eval_multiplier)
            held = evidence_held(memory.evidence, top_k(model.scores(memory.memory.tolist(), memory.questions), k))
            found[names.index(memory.variant)] += sum(held)
            asked[names.index(memory.variant)] += len(held)
        model.train()
        totals = summed_over_ranks(torch.tensor(np.concatenate([found, asked]), dtype=torch.float64)).numpy()
        found, asked = totals[: len(names)], totals[len(names):]
        metrics = {f"recall_at_{k}/{name}": found[i] / asked[i] for i, name in enumerate(names) if asked[i]}
        return metrics | {f"recall_at_{k}": found.sum() / max(asked.sum(), 1.0)}

    def export(self, engine, config: RetrieverConfig, worker: dict[str, Any], directory: Path) -> None:
        """The retriever (models.retriever: the encoder's checkpoint and retriever.json), gathered from the ZeRO-3
        shards and written by rank 0: the directory --model.retriever names."""
        model = engine.module
        with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=config.deepspeed.stage == 3):
            if dist.get_rank() == 0:
                model.save_pretrained(directory)
        dist.barrier()

    def finish(self, engine, config: RetrieverConfig, state: TrainState, tracker: Tracker, rank: int,
               world: int) -> None:
        return None

    def summary(self, config: RetrieverConfig, metrics: dict[str, Any], export_dir: str | None,
                tracker: Tracker) -> dict[str, Any]:
        k = config.model.k
        return {"loss_first": metrics.get("loss_first"), "loss_last": metrics.get("loss"),
                f"recall_at_{k}": {name.split("/", 1)[1]: round(value, 3) for name, value in metrics.items()
                                if name.startswith(f"recall_at_{k}/")},
                "retriever": export_dir}


RETRIEVER = RetrieverRecipe()


def encoder_directory(config: RetrieverConfig) -> str:
    """The encoder the retriever starts from: model.encoder_checkpoint, else the pair's (a tiny pair's random
    checkpoints written first, as the stage jobs write them)."""
    m = config.model
    if m.encoder_checkpoint:
        return str(Path(m.encoder_checkpoint).expanduser().resolve())
    return str(pair_checkpoints(m.pair, m.checkpoint_root)[1].expanduser().resolve())
