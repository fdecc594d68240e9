"""The UL2 job's recipe (the encoder-decoder's denoising pre-training), whose encoder then serves as the Awareness
memory encoder: a Qwen3 seq2seq model, UL2 denoising batches, and the seq2seq + encoder exports."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from tokenizers import Tokenizer
from transformers import Qwen3ForCausalLM

from models import Qwen3EncoderModel, Qwen3ForSeq2SeqLM
from models.pairs import PAIRS, decoder_config, default_tiny_root
from pipelines.data.ul2 import collate, ul2_dataset
from pipelines.format.rows import IGNORE
from pipelines.format.tokenizer import TOKENIZER_FILE, load_tokenizer, ul2_vocab, write_byte_tokenizer
from pipelines.tracking.tracker import Tracker
from pipelines.train.configs.ul2 import Ul2Config
from pipelines.train.recipes import Loss, Prepared, TrainState, model_loss, trainable_groups
from pipelines.train.streams import DatasetStream

TINY_CHECKPOINT = "tiny-qwen3-ul2"
GROUP = "seq2seq"  # every parameter trains in full, at the schedule's rate (no decoder warm-up phase here)


class Ul2Recipe:
    """The UL2 job: Recipe (pipelines.train.recipes) for Qwen3ForSeq2SeqLM on denoising batches."""

    def parse(self, data: dict[str, Any]) -> Ul2Config:
        return Ul2Config.from_dict(data)

    def prepare(self, config: Ul2Config) -> Prepared:
        config = dataclasses.replace(config, run=dataclasses.replace(
            config.run, storage_path=str(Path(config.run.storage_path).expanduser().resolve())))
        checkpoint, tokenizer_dir = prepare_checkpoint(config)
        vocab = ul2_vocab(Tokenizer.from_file(str(Path(tokenizer_dir) / TOKENIZER_FILE)))
        return Prepared(config, datasets={"train": ul2_dataset(config.data, tokenizer_dir)},
                        worker={"checkpoint": checkpoint, "start_token": vocab.start, "pad": vocab.pad},
                        tags={"job": "encoder_ul2", "checkpoint": checkpoint})

    def build_model(self, config: Ul2Config, worker: dict[str, Any], ds_config: dict[str, Any]) -> Qwen3ForSeq2SeqLM:
        """Built whole on every worker, then partitioned by deepspeed.initialize: from_qwen3 builds the seq2seq
        model from a loaded decoder with plain tensor copies, which are not written for zero.Init's partitions
        (the UL2 checkpoints, up to 1.7B, fit whole)."""
        cfg = config.model
        model = Qwen3ForSeq2SeqLM.from_qwen3(worker["checkpoint"], encoder_key_rope=cfg.encoder_key_rope,
                                             encoder_layers=cfg.encoder_layers,
                                             decoder_start_token_id=worker["start_token"])
        if cfg.gradient_checkpointing:
            model.activation_checkpointing_enable()  # transformers 5.24 deprecates the gradient_ name
        return model.train()

    def parameter_groups(self, model: torch.nn.Module) -> dict[str, list[torch.nn.Parameter]]:
        return trainable_groups(model, lambda name: GROUP)

    def stream(self, config: Ul2Config, worker: dict[str, Any], rank: int, world: int, start_step: int):
        return DatasetStream(config.train, world, lambda rows: collate(rows, worker["pad"]))

    def count_tokens(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["attention_mask"].sum()) + int((batch["labels"] != IGNORE).sum())

    def loss(self, engine, config: Ul2Config, batch: dict[str, torch.Tensor]) -> Loss:
        return model_loss(engine, batch)

    def before_step(self, engine, config: Ul2Config, state: TrainState, stream) -> dict[str, float]:
        return {}

    def probe(self, engine, config: Ul2Config, state: TrainState, stream) -> dict[str, float]:
        return {}

    def evaluate(self, engine, config: Ul2Config, rank: int, world: int) -> dict[str, float]:
        return {}

    def export(self, engine, config: Ul2Config, worker: dict[str, Any], directory: Path) -> None:
        """export/seq2seq (the whole model) and export/encoder (a plain Qwen3 checkpoint for the Awareness memory
        encoder), each with the tokenizer, gathered from the ZeRO-3 shards and written by rank 0."""
        model = engine.module
        with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=config.deepspeed.stage == 3):
            if dist.get_rank() == 0:
                model.save_pretrained(directory / "seq2seq")
                Qwen3EncoderModel.from_seq2seq(model).save_pretrained(directory / "encoder")
                for sub in ("seq2seq", "encoder"):
                    shutil.copy(Path(worker["checkpoint"]) / TOKENIZER_FILE, directory / sub / TOKENIZER_FILE)
        dist.barrier()

    def finish(self, engine, config: Ul2Config, state: TrainState, tracker: Tracker, rank: int, world: int) -> None:
        return None

    def summary(self, config: Ul2Config, metrics: dict[str, Any], export_dir: str | None,
                tracker: Tracker) -> dict[str, Any]:
        if export_dir and Path(export_dir).is_dir():
            tracker.log_artifacts(Path(export_dir) / "encoder", "encoder")
        return {"loss_first": metrics.get("loss_first"), "loss_last": metrics.get("loss"),
                "seq2seq": f"{export_dir}/seq2seq" if export_dir else None,
                "encoder": f"{export_dir}/encoder" if export_dir else None}


UL2 = Ul2Recipe()


def prepare_checkpoint(config: Ul2Config) -> tuple[str, str]:
    """(checkpoint dir, tokenizer dir). The tiny default: the `tiny` pair's decoder architecture with random
    weights and a byte-level tokenizer, written once under the checkpoint root. A real checkpoint: its own
    tokenizer.json plus UL2's added tokens, saved next to the run (never into the checkpoint)."""
    if config.model.checkpoint:
        checkpoint = Path(config.model.checkpoint).expanduser().resolve()
        run_dir = Path(config.run.storage_path) / config.run.name
        run_dir.mkdir(parents=True, exist_ok=True)
        load_tokenizer(checkpoint, _vocab_size(checkpoint)).save(str(run_dir / TOKENIZER_FILE))
        return str(checkpoint), str(run_dir)
    root = Path(config.model.checkpoint_root or default_tiny_root()).expanduser().resolve()
    directory = root / TINY_CHECKPOINT
    if not (directory / TOKENIZER_FILE).is_file() or not (directory / "config.json").is_file():
        torch.manual_seed(0)
        Qwen3ForCausalLM(decoder_config(PAIRS["tiny"])).save_pretrained(directory)
        write_byte_tokenizer(directory)
    return str(directory), str(directory)


def _vocab_size(checkpoint: Path) -> int:
    return int(json.loads((checkpoint / "config.json").read_text())["vocab_size"])
