"""Stage 2, commit reproduction from the message alone: every prompt variant (raw message, hinted, imperative, and
the planning dialogue plan -> <read> -> edit), usually starting from stage 1's export.

    python jobs/stage2.py --data.train_path corpus/train --data.val_path corpus/val --model.init_from STAGE1_EXPORT
    ray job submit --working-dir . -- python jobs/stage2.py --model.pair scale --scaling.use_gpu true \\
        --scaling.num_workers 16 --data.train_path s3://bucket/corpus/train --data.val_path s3://bucket/corpus/val

Ends with a one-line JSON summary.
"""

from __future__ import annotations

import sys

from pipelines.config import DataConfig, ModelConfig, RunSettings, ScalingSettings, StageConfig, TrainConfig
from pipelines.jobs import run_job

DEFAULT = StageConfig(
    stage=2,
    model=ModelConfig(pair="tiny-text", gca_layers="upper_third", decoder="lora", encoder="frozen", gca="full"),
    data=DataConfig(variants=None, max_tokens=4096, max_chunks=32, chunk_len=512),
    train=TrainConfig(max_steps=2000, memories_per_step=8, lr=1e-4, warmup_steps=50, eval_every=250,
                      checkpoint_every=250, log_every=20),
    scaling=ScalingSettings(cpus_per_worker=0.5),  # leaves CPUs for Ray Data's read tasks on a laptop
    run=RunSettings(name="stage2"),
)

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:], DEFAULT, __doc__))
