"""Stage 1, commit reproduction with help: reproduce a real single-file change from its message plus hints (path,
hunk headers) or an imperative instruction, reading the repository at the parent commit as memory.

    python jobs/build_corpus.py --stage 2 --sources PATH/TO/REPO --out corpus     # the commit shards, once
    python jobs/stage1.py --data.train_path corpus/train --data.val_path corpus/val
    ray job submit --working-dir . -- python jobs/stage1.py --model.pair proto2 --scaling.use_gpu true \\
        --data.train_path /mnt/shared/corpora/c2/train --data.val_path /mnt/shared/corpora/c2/val  # shared storage

The plan's schedule: GCA and projection alone first (decoder frozen for train.frozen_decoder_steps), then LoRA on
the decoder too; the encoder stays frozen. Ends with a one-line JSON summary; its `export` feeds stage 2's
--model.init_from.
"""

from __future__ import annotations

import sys

from pipelines.train.job import run_job
from pipelines.train.presets import STAGE1

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:], STAGE1, __doc__))
