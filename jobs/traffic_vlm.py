"""The traffic-scene VLM: a SigLIP vision tower's 196 patch tokens read by the seed's cross-attention decoder, trained
on rendered traffic scenes to answer YES/NO questions ("Is the light red?", "Can the car go?").

    python jobs/traffic_vlm.py                                   # embedded default: random tower, 6 question types, CPU
    python jobs/traffic_vlm.py --train.max_steps 50              # any config field, as --section.field VALUE
    python jobs/traffic_vlm.py --model.vision_path /ckpt/siglip-base-patch16-224 --scaling.use_gpu true
    python jobs/traffic_vlm.py --dry-run                         # validate and print the resolved config, no Ray
    ray job submit --working-dir . -- python jobs/traffic_vlm.py --train.max_steps 800

Logs held-out accuracy (with the image and with it withheld), majority rate, F1 and per-type accuracy to MLflow,
with the confusion matrix, a grid of held-out scenes and the cross-attention map; the model lands in
<checkpoint>/export and as a registered pyfunc ({image: PNG bytes or base64, question} -> yes/no).
Ends with a one-line JSON summary.
"""

from __future__ import annotations

import sys

from pipelines.train.job import run_job
from pipelines.train.presets import TRAFFIC_VLM

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:], TRAFFIC_VLM, __doc__))
