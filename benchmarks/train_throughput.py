"""Training-step throughput: Ray Train + DeepSpeed ZeRO-3 over 2 CPU workers against the same model, data and
global batch trained in one plain PyTorch process. Prints tokens/s and the ratio, measured side by side.

    python benchmarks/train_throughput.py [--steps 60]

Tokens are decoder tokens (questions) plus memory tokens, per optimizer step.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from pipelines.data.synthetic_needles import PROMPT_LEN, make_batch
from pipelines.train.configs.common import RunSettings, TrackingSettings, TrainConfig
from pipelines.train.configs.stage import ModelConfig, NeedleConfig, StageConfig
from pipelines.train.model import build_model


def stage_config(pair: str, steps: int, storage: str) -> StageConfig:
    return StageConfig(
        model=ModelConfig(pair=pair, gca_layers="upper_half", decoder="full", encoder="full", gca="full"),
        needle=NeedleConfig(val_memories=8),
        train=TrainConfig(max_steps=steps, memories_per_step=16, lr=1e-3, log_every=steps, eval_every=steps,
                          checkpoint_every=steps),
        run=RunSettings(name=f"bench-{pair}", storage_path=storage, max_failures=0),
        tracking=TrackingSettings(enabled=False),
    )


def tokens_per_step(config: StageConfig) -> int:
    spec = config.needle.spec()
    questions = config.train.memories_per_step * spec.questions * (PROMPT_LEN + spec.value_digits + 1)
    return questions + config.train.memories_per_step * spec.chunks * spec.chunk_len


def plain_pytorch(config: StageConfig, warmup: int = 5) -> float:
    """Seconds per step of the same model and batch in one process with torch's AdamW (all cores)."""
    torch.manual_seed(0)
    model = build_model(config.model).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.train.lr)
    spec, m = config.needle.spec(), config.train.memories_per_step
    times = []
    for step in range(config.train.max_steps):
        batch = make_batch(spec, 0, list(range(step * m, (step + 1) * m)))
        start = time.perf_counter()
        loss = model(input_ids=batch["input_ids"], labels=batch["labels"],
                     memory_input_ids=batch["memory_input_ids"]).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - start)
    return sorted(times[warmup:])[len(times[warmup:]) // 2]


def ray_zero3(config: StageConfig) -> float:
    """Median seconds per step through run_training_job: 2 workers, ZeRO-3 over gloo (start-up, evaluation and
    checkpointing excluded)."""
    from pipelines.train.driver import shutdown_ray
    from pipelines.train.recipes.jobs import train

    summary = train(config)
    shutdown_ray()
    assert summary["error"] is None, summary
    return summary["seconds_per_step"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; global batch 16 memories x 8 questions")
    print(f"| {'pair':<6} | {'plain PyTorch tok/s':>19} | {'Ray + ZeRO-3 x2 tok/s':>21} | {'ZeRO-3 / plain':>14} |")
    print(f"|{'-' * 8}|{'-' * 21}|{'-' * 23}|{'-' * 16}|")
    for pair in ("tiny", "small"):
        with tempfile.TemporaryDirectory() as storage:
            config = stage_config(pair, args.steps, storage)
            plain = tokens_per_step(config) / plain_pytorch(config)
            zero3 = tokens_per_step(config) / ray_zero3(config)
        print(f"| {pair:<6} | {plain:19.0f} | {zero3:21.0f} | {zero3 / plain:14.2f} |", flush=True)


if __name__ == "__main__":
    main()
