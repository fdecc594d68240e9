"""Stage 0 on the questions retrieval cannot match: the stage-0 mixture plus alias, alias_multi_key and two_hop
(docs/jobs.md, "Questions retrieval cannot match"), 5,800-7,400 steps: about 12-17 minutes on 2 CPU cores.

    python jobs/beyond_lexical.py                           # embedded default: tiny pair, CPU, 5,000 mixture steps
    python jobs/beyond_lexical.py --train.seed 1            # any config field, as --section.field VALUE
    python jobs/beyond_lexical.py --dry-run                 # validate and print the resolved config, no Ray

Ends with a one-line JSON summary.
"""

from __future__ import annotations

import sys

from pipelines.train.job import run_job
from pipelines.train.presets import BEYOND_LEXICAL

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:], BEYOND_LEXICAL, __doc__))
