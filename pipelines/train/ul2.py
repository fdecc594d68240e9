"""The UL2 job's Ray Train worker and driver (the encoder-decoder's denoising pre-training)."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from pipelines.data.tokenizer import TOKENIZER_FILE, load_tokenizer, ul2_vocab, write_byte_tokenizer
from pipelines.data.ul2 import collate, ul2_dataset
from pipelines.train.config import Ul2Config, Ul2ModelConfig
from pipelines.train.engine import EXPORT_DIR

TINY_CHECKPOINT = "tiny-qwen3-ul2"


# ------------------------------------------------------------------------------------------- Ray Train worker
@dataclass
class Ul2State:
    """What a checkpoint carries besides the engine's shards."""

    step: int = 0
    examples_seen: int = 0
    losses: list[float] = field(default_factory=list)  # every step's loss (Ray keeps only checkpointed reports)


def ul2_train_loop(loop_config: dict[str, Any]) -> None:
    import ray.train

    from pipelines.tracking.tracker import Tracker
    from pipelines.train.engine import quiet_known_warnings, restore_checkpoint, save_checkpoint

    config = Ul2Config.from_dict(loop_config["config"])
    quiet_known_warnings()
    torch.manual_seed(config.train.seed)
    model = build_seq2seq(config.model, loop_config["checkpoint"], loop_config["start_token"])
    engine = setup_engine(model, config)
    state = restore_checkpoint(engine, Ul2State)
    rank = ray.train.get_context().get_world_rank()
    tracker = Tracker(loop_config.get("tracking_uri"), loop_config.get("mlflow_run_id") if rank == 0 else None)
    batches = batch_stream(config, loop_config["pad"])
    seconds: list[float] = []
    while state.step < config.train.max_steps:
        metrics = ul2_step(engine, batches, config, state)
        seconds.append(metrics["step_seconds"])
        metrics["step_seconds_median"] = statistics.median(seconds[-100:])
        final = state.step == config.train.max_steps
        if state.step % config.train.log_every == 0 or final:
            tracker.log_metrics(metrics, state.step)
        if state.step % config.train.checkpoint_every == 0 or final:
            save_checkpoint(engine, state, metrics,
                            export=functools.partial(export, engine, config, checkpoint=loop_config["checkpoint"]) if final else None)
        else:
            ray.train.report(metrics)


def build_seq2seq(cfg: Ul2ModelConfig, checkpoint: str, start_token: int):
    from models import Qwen3ForSeq2SeqLM

    model = Qwen3ForSeq2SeqLM.from_qwen3(checkpoint, encoder_key_rope=cfg.encoder_key_rope,
                                         encoder_layers=cfg.encoder_layers, decoder_start_token_id=start_token)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.train()


def setup_engine(model, config: Ul2Config):
    """The stage jobs' DeepSpeed setup (AdamW + cosine schedule handed to DeepSpeed, ZeRO config from train /
    deepspeed sections); everything trains, so it is one parameter group."""
    from pipelines.train.engine import setup_deepspeed

    return setup_deepspeed(model, config)  # reads only config.train and config.deepspeed


def batch_stream(config: Ul2Config, pad: int) -> Iterator[dict[str, torch.Tensor]]:
    """This worker's shard of the dataset, micro-batch by micro-batch, epoch after epoch (equal shards and
    drop_last keep every worker on the same step count, as DeepSpeed's collectives need)."""
    import ray.train

    shard = ray.train.get_dataset_shard("train")
    t = config.train
    per_rank = t.memories_per_step // (t.grad_accum * ray.train.get_context().get_world_size())
    while True:
        for batch in shard.iter_batches(batch_size=per_rank, drop_last=True, batch_format="numpy"):
            yield collate(batch, pad)


def ul2_step(engine, batches: Iterator, config: Ul2Config, state) -> dict[str, float]:
    import torch.distributed as dist

    started, losses, tokens = time.perf_counter(), [], 0
    for _ in range(config.train.grad_accum):
        batch = {k: v.to(engine.device) for k, v in next(batches).items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        tokens += int(batch["attention_mask"].sum()) + int((batch["labels"] != -100).sum())
    totals = torch.tensor([torch.stack(losses).mean().item(), tokens], dtype=torch.float64)
    dist.all_reduce(totals)
    state.step += 1
    state.examples_seen += config.train.memories_per_step
    state.losses.append(totals[0].item() / dist.get_world_size())
    elapsed = time.perf_counter() - started
    return {"loss": state.losses[-1], "loss_first": state.losses[0], "lr": engine.get_lr()[0],
            "tokens_per_s": totals[1].item() / elapsed, "step_seconds": elapsed,
            "examples_seen": state.examples_seen}


def export(engine, config: Ul2Config, directory: Path, checkpoint: str) -> None:
    """export/seq2seq (the whole model) and export/encoder (a plain Qwen3 checkpoint for the Awareness memory
    encoder), each with the tokenizer, gathered from the ZeRO-3 shards and written by rank 0."""
    import deepspeed
    import torch.distributed as dist

    from models import Qwen3EncoderModel

    model = engine.module
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=config.deepspeed.zero_stage == 3):
        if dist.get_rank() == 0:
            model.save_pretrained(directory / "seq2seq")
            Qwen3EncoderModel.from_seq2seq(model).save_pretrained(directory / "encoder")
            for sub in ("seq2seq", "encoder"):
                shutil.copy(Path(checkpoint) / TOKENIZER_FILE, directory / sub / TOKENIZER_FILE)
    dist.barrier()


# ---------------------------------------------------------------------------------------------------- driver
def prepare_checkpoint(config: Ul2Config) -> tuple[str, str]:
    """(checkpoint dir, tokenizer dir). The tiny default: the `tiny` pair's decoder architecture with random
    weights and a byte-level tokenizer, written once under the checkpoint root. A real checkpoint: its own
    tokenizer.json plus UL2's added tokens, saved next to the run (never into the checkpoint)."""
    from models.pairs import PAIRS, decoder_config, default_tiny_root

    if config.model.checkpoint:
        return str(Path(config.model.checkpoint).expanduser().resolve()), ""
    root = Path(config.model.checkpoint_root or default_tiny_root()).expanduser().resolve()
    directory = root / TINY_CHECKPOINT
    if not (directory / TOKENIZER_FILE).is_file() or not (directory / "config.json").is_file():
        from transformers import Qwen3ForCausalLM

        torch.manual_seed(0)
        Qwen3ForCausalLM(decoder_config(PAIRS["tiny"])).save_pretrained(directory)
        write_byte_tokenizer(directory)
    return str(directory), str(directory)


def run_ul2(config: Ul2Config) -> dict[str, Any]:
    """Trains on Ray Train and returns the job's summary; a rerun with the same run.name resumes."""
    import ray
    import ray.train
    from ray.train.torch import TorchTrainer

    from pipelines.tracking.tracker import Tracker, resolve_tracking_uri

    config = config.validate()
    config = dataclasses.replace(config, run=dataclasses.replace(
        config.run, storage_path=str(Path(config.run.storage_path).expanduser().resolve())))
    checkpoint, tokenizer_dir = prepare_checkpoint(config)
    run_dir = Path(config.run.storage_path) / config.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    if not tokenizer_dir:  # a real checkpoint: its tokenizer with UL2's tokens, kept with the run
        load_tokenizer(checkpoint, _vocab_size(checkpoint)).save(str(run_dir / TOKENIZER_FILE))
        tokenizer_dir = str(run_dir)
    from tokenizers import Tokenizer

    vocab = ul2_vocab(Tokenizer.from_file(str(Path(tokenizer_dir) / TOKENIZER_FILE)))
    tracking_uri = resolve_tracking_uri(config.tracking.tracking_uri)
    tracker = Tracker(None, None)
    if config.tracking.enabled:
        tracker = Tracker.start(tracking_uri, config.tracking.experiment, config.run.name, config.to_dict(),
                                {"job": "encoder_ul2", "checkpoint": checkpoint})
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    trainer = TorchTrainer(
        ul2_train_loop,
        train_loop_config={"config": config.to_dict(), "checkpoint": checkpoint, "start_token": vocab.start,
                           "pad": vocab.pad, "tracking_uri": tracking_uri, "mlflow_run_id": tracker.run_id},
        datasets={"train": ul2_dataset(config.data, tokenizer_dir)},
        scaling_config=ray.train.ScalingConfig(
            num_workers=config.scaling.num_workers, use_gpu=config.scaling.use_gpu,
            resources_per_worker={"CPU": config.scaling.cpus_per_worker, **({"GPU": 1} if config.scaling.use_gpu else {})},
        ),
        run_config=ray.train.RunConfig(
            name=config.run.name, storage_path=config.run.storage_path,
            failure_config=ray.train.FailureConfig(max_failures=config.run.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=config.run.keep_checkpoints),
        ),
    )
    return summarise(config, trainer.fit(), tracker)


def _vocab_size(checkpoint: str) -> int:
    return int(json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"])


def summarise(config: Ul2Config, result, tracker) -> dict[str, Any]:
    metrics = result.metrics or {}
    checkpoint = result.checkpoint.path if result.checkpoint else None
    export_dir = f"{checkpoint}/{EXPORT_DIR}" if checkpoint else None
    summary = {
        "job": "encoder_ul2",
        "steps": metrics.get("examples_seen", 0) // config.train.memories_per_step,
        "loss_first": metrics.get("loss_first"),
        "loss_last": metrics.get("loss"),
        "seconds_per_step": metrics.get("step_seconds_median"),
        "checkpoint": checkpoint,
        "seq2seq": f"{export_dir}/seq2seq" if export_dir else None,
        "encoder": f"{export_dir}/encoder" if export_dir else None,
        "mlflow_run_id": tracker.run_id,
        "error": repr(result.error) if result.error else None,
    }
    if checkpoint and Path(checkpoint, EXPORT_DIR).is_dir():
        tracker.log_artifacts(Path(checkpoint) / EXPORT_DIR / "encoder", "encoder")
    tracker.log_dict(summary, "summary.json")
    summary["tracking_unlogged"] = tracker.close("FAILED" if result.error else "FINISHED")
    return summary
