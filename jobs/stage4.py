"""Stage 4, distillation: the GCA student learns from a teacher that reads the same memory in its prompt, with
alpha * KL(teacher || student) over the teacher's top-k (computed once with Ray Data, stored beside the corpus's
shards) + (1 - alpha) * cross-entropy; the same student also trains with alpha 0 on the same data and steps.

    python jobs/stage4.py                                   # embedded default: CPU, a teacher trained first (cached)
    python jobs/stage4.py --data.train_path corpus/train --data.val_path corpus/val --distill.teacher TEACHER_EXPORT \\
        --model.init_from STAGE2_EXPORT --model.pair tiny-text --distill.k 64 --distill.alpha 0.5

TEACHER_EXPORT: a stage run's export trained with --model.memory in_context (or rag). Ends with a one-line JSON
summary (kl_first, kl_last, student_val_loss, baseline_val_loss, ...).
"""

from __future__ import annotations

import sys

from pipelines.train.job import run_job
from pipelines.train.presets import STAGE4

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:], STAGE4, __doc__))
