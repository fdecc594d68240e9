"""Stage 2, commit reproduction from the message alone: every prompt variant (raw message, hinted, imperative, and
the planning dialogue plan -> <read> -> edit), usually starting from stage 1's export.

    python jobs/stage2.py --data.train_path corpus/train --data.val_path corpus/val --model.init_from STAGE1_EXPORT
    ray job submit --working-dir . -- python jobs/stage2.py --model.pair scale --scaling.use_gpu true \\
        --model.checkpoint_root /mnt/shared/checkpoints --scaling.num_workers 16 \\
        --data.train_path /mnt/shared/corpora/c2/train --data.val_path /mnt/shared/corpora/c2/val

On the two-node cluster of cluster.yaml (2 x 8 GPUs): its header has the whole sequence of commands.

Ends with a one-line JSON summary.
"""

from __future__ import annotations

import sys

from pipelines.train.job import run_job
from pipelines.train.presets import STAGE2

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:], STAGE2, __doc__))
