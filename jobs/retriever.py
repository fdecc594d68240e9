"""The dense-rag baseline's retriever: the pair's memory encoder trained contrastively on the needle questions and
their evidence chunks (questions and chunks embedded alike, mean-pooled; every other chunk of the batch a negative).

    python jobs/retriever.py                          # embedded default: the tiny pair's encoder, stage 0's needles
    python jobs/retriever.py --needle.variants single alias two_hop --needle.base_steps 0 --train.max_steps 500
    python jobs/retriever.py --dry-run                # validate and print the resolved config, no Ray

Its export (<checkpoint>/export, the summary's "retriever") is what a dense_rag reader reads with:
python jobs/stage0.py --model.memory dense_rag --model.retriever EXPORT. Ends with a one-line JSON summary.
"""

from __future__ import annotations

import sys

from pipelines.train.job import run_job
from pipelines.train.presets import RETRIEVER

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:], RETRIEVER, __doc__))
