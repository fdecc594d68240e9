"""Stage 0, context grounding: teach the decoder to answer from its memory.

    python jobs/stage0.py                                   # embedded default: tiny pair, CPU, synthetic needles
    python jobs/stage0.py --train.max_steps 50              # any config field, as --section.field VALUE
    python jobs/stage0.py --config my.yaml                  # a file with any of the sections
    ray job submit --working-dir . -- python jobs/stage0.py --model.pair proto1 --scaling.use_gpu true

Ends with a one-line JSON summary.
"""

from __future__ import annotations

import sys

from pipelines.train.job import run_job
from pipelines.train.presets import STAGE0

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:], STAGE0, __doc__))
