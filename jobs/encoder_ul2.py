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

from pipelines.config import RunSettings, TrainConfig
from pipelines.stage import shutdown_ray
from pipelines.tracking import summary_json
from pipelines.ul2 import Ul2Config, Ul2DataConfig, parse_ul2_config, run_ul2

# The embedded default: a tiny random Qwen3 (the `tiny` pair's decoder) with a byte-level tokenizer, trained on
# this repository's own sources; everything trains in full. A few minutes on 2 CPU cores.
DEFAULT = Ul2Config(
    data=Ul2DataConfig(seq_len=128),
    train=TrainConfig(max_steps=200, memories_per_step=16, lr=2e-3, warmup_steps=10, log_every=10,
                      checkpoint_every=100),
    run=RunSettings(name="encoder-ul2-tiny"),
)


def main(argv: list[str] | None = None) -> dict:
    config = parse_ul2_config(argv, DEFAULT, description=__doc__)
    summary = run_ul2(config)
    shutdown_ray()  # flushes the workers' forwarded logs, so the summary is the last line
    print(summary_json(summary), flush=True)
    return summary


if __name__ == "__main__":
    summary = main()
    sys.exit(1 if summary.get("error") else 0)
