"""UL2 for the Qwen3 encoder-decoder (R/S/X denoisers), whose encoder then serves as the Awareness memory encoder.

    python jobs/encoder_ul2.py                                   # embedded default: tiny random Qwen3, CPU, this repo's files
    python jobs/encoder_ul2.py --train.max_steps 50              # any config field, as --section.field VALUE
    python jobs/encoder_ul2.py --model.checkpoint /ckpt/Qwen3-0.6B --data.paths /data/code --scaling.use_gpu true
    ray job submit --working-dir . -- python jobs/encoder_ul2.py --config ul2.yaml

The encoder lands in <checkpoint>/export/encoder; use it with build_pair(..., encoder_checkpoint=that directory).
Ends with a one-line JSON summary.
"""

from __future__ import annotations

import sys

from pipelines.cli import parse_config
from pipelines.tracking.tracker import summary_json
from pipelines.train.driver import shutdown_ray
from pipelines.train.presets import ENCODER_UL2
from pipelines.train.ul2 import run_ul2


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(argv, ENCODER_UL2, description=__doc__)
    summary = run_ul2(config)
    shutdown_ray()  # flushes the workers' forwarded logs, so the summary is the last line
    print(summary_json(summary), flush=True)
    return summary


if __name__ == "__main__":
    summary = main()
    sys.exit(1 if summary.get("error") else 0)
