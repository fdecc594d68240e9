"""Encode a repository once into a memory store, on Ray Data: what `jobs/evaluate.py` and the served pyfunc read
instead of running the encoder for every query.

    python jobs/encode_memory.py --model EXPORT_OR_ENCODER --sources REPO --out STORE
    python jobs/encode_memory.py --model EXPORT --sources REPO --out STORE --use_gpu true --actors 4

Writes STORE/store.json (chunks, token counts, rejected files by reason, the encoder's identity), STORE/chunks.jsonl
and STORE/states-*.safetensors; ends with a one-line JSON summary.
"""

from __future__ import annotations

import json
import sys

from pipelines.cli import parse_config
from pipelines.data.ray_session import data_job_ray
from pipelines.memory.encoding import EncodeMemoryConfig, encode_repository
from pipelines.memory.store import encoder_source


def refuse(error: Exception) -> None:
    """A problem the user fixes (no such model, nothing to encode): one line on stderr, the summary, exit 2."""
    print(f"encode_memory: {error}", file=sys.stderr)
    print(json.dumps({"job": "encode_memory", "error": str(error)}), flush=True)
    sys.exit(2)


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(argv, EncodeMemoryConfig(), description=__doc__)
    try:
        encoder_source(config.model, config.encoder_attention)  # before Ray starts: an export or encoder directory
    except FileNotFoundError as error:
        refuse(error)
    try:
        with data_job_ray(config.num_cpus, log_to_driver=False):
            manifest = encode_repository(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except (FileNotFoundError, ValueError) as error:
        refuse(error)
    summary = {"job": "encode_memory", "store": config.out, "chunks": len(manifest["chunks"]),
               "tokens": manifest["tokens"], "files": manifest["files"], "rejects": manifest["rejects"],
               "encoder": manifest["encoder"]["checkpoint"], "seconds": manifest["seconds"]}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
