"""UL2 for the Qwen3 encoder-decoder (R/S/X denoisers), whose encoder then serves as the Awareness memory encoder.

    python jobs/encoder_ul2.py                         # embedded default: tiny random Qwen3, CPU, this repo's files
    python jobs/encoder_ul2.py --train.max_steps 50    # any config field, as --section.field VALUE
    python jobs/encoder_ul2.py --model.checkpoint /ckpt/Qwen3-0.6B --data.paths /data/code /data/docs \\
        --scaling.use_gpu true
    python jobs/encoder_ul2.py --dry-run               # validate and print the resolved config, no Ray
    ray job submit --working-dir . -- python jobs/encoder_ul2.py --config ul2.yaml

The encoder lands in <checkpoint>/export/encoder; use it with build_pair(..., encoder_checkpoint=that directory).
Ends with a one-line JSON summary.
"""

from __future__ import annotations

import sys

from pipelines.train.job import run_job
from pipelines.train.presets import ENCODER_UL2

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:], ENCODER_UL2, __doc__))
