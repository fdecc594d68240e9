"""Stage 1, commit reproduction with help: reproduce a real single-file change from its message plus hints (path,
hunk headers) or an imperative instruction, reading the repository at the parent commit as memory.

    python jobs/build_corpus.py --stage 2 --source PATH/TO/REPO --out corpus     # the commit shards, once
    python jobs/stage1.py --data.train_path corpus/train --data.val_path corpus/val
    ray job submit --working-dir . -- python jobs/stage1.py --model.pair proto2 --scaling.use_gpu true \\
        --data.train_path s3://bucket/corpus/train --data.val_path s3://bucket/corpus/val

The plan's schedule: GCA and projection alone first (decoder frozen for train.frozen_decoder_steps), then LoRA on
the decoder too; the encoder stays frozen. Ends with a one-line JSON summary; its `export` feeds stage 2's
--model.init_from.
"""

from __future__ import annotations

import sys

from pipelines.config import DataConfig, ModelConfig, RunSettings, ScalingSettings, StageConfig, TrainConfig
from pipelines.jobs import run_job

# tiny-text: the tiny shapes with Qwen3's vocabulary, so a laptop trains on real shards; pass --model.pair for more.
DEFAULT = StageConfig(
    stage=1,
    model=ModelConfig(pair="tiny-text", gca_layers="upper_third", decoder="lora", encoder="frozen", gca="full"),
    data=DataConfig(variants="hinted,imperative", max_tokens=2048, max_chunks=16, chunk_len=512),
    train=TrainConfig(max_steps=1000, memories_per_step=8, lr=2e-4, warmup_steps=30, frozen_decoder_steps=100,
                      eval_every=200, checkpoint_every=200, log_every=20),
    scaling=ScalingSettings(cpus_per_worker=0.5),  # leaves CPUs for Ray Data's read tasks on a laptop
    run=RunSettings(name="stage1"),
)

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:], DEFAULT, __doc__))
