"""A registered model and its questions, small enough for a test or a benchmark's own setup: the tiny pair with its
GCA gates opened (so the memory changes the answer), logged as a stage-like run's export and registered as the served
pyfunc; and stage-0 needle questions as served text (rows of {question, memory})."""

from __future__ import annotations

from pathlib import Path

import torch
from mlflow.tracking import MlflowClient

from models import AwarenessModel, build_pair
from pipelines.data.needle_tokenizer import needle_tokenizer
from pipelines.data.synthetic_needles import PROMPT_LEN, NeedleSpec, make_example
from pipelines.serving.register import register_run

# What a stage-0 needle run logs that registration reads (answer length, how answers end).
NEEDLE_PARAMS = {"model.pair": "tiny", "needle.value_digits": "3", "data.train_path": "None"}


def tiny_export(directory: Path, checkpoint_root: str | Path, gate: float = 2.0) -> AwarenessModel:
    """The tiny pair (seeded), GCA in its upper half, every gate at `gate`, saved to `directory`. The model."""
    torch.manual_seed(0)
    model = build_pair("tiny", checkpoint_root=checkpoint_root, gca_layers="upper_half").eval()
    with torch.no_grad():
        for block in model.gca_blocks().values():
            block.gate.fill_(gate)
    model.save_pretrained(directory)
    return model


def register_export(export: str | Path, tracking_uri: str, experiment_name: str, name: str, *,
                    params: dict[str, str] | None = None, tags: dict[str, str] | None = None):
    """An export directory logged as the `export` artifact of a new run (with a stage run's params) and registered
    under `name` (alias candidate). (its ModelVersion, the run id)."""
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment_name)
    experiment = found.experiment_id if found else client.create_experiment(experiment_name)
    params = NEEDLE_PARAMS if params is None else params
    run = client.create_run(experiment, tags={"pair": params.get("model.pair", ""), **(tags or {})})
    for key, value in params.items():
        client.log_param(run.info.run_id, key, value)
    client.log_artifacts(run.info.run_id, str(export), "export")
    return register_run(run.info.run_id, tracking_uri=tracking_uri, name=name), run.info.run_id


def register_tiny_export(tmp: Path, checkpoint_root, tracking_uri: str, experiment_name: str, name: str,
                         tags: dict[str, str] | None = None) -> tuple[AwarenessModel, object, str]:
    """The tiny export (tiny_export, under tmp/export) registered: (the model, its registered version, the run id)."""
    model = tiny_export(Path(tmp) / "export", checkpoint_root)
    version, run_id = register_export(Path(tmp) / "export", tracking_uri, experiment_name, name,
                                      tags={"pair": "tiny", **(tags or {})})
    return model, version, run_id


def needle_questions(seed: int, memories: int, spec: NeedleSpec = NeedleSpec()) -> tuple[list[dict], list[str]]:
    """Stage-0 needle questions as served text: rows of {question, memory} and each question's true value."""
    tokenizer = needle_tokenizer()
    rows, values = [], []
    for index in range(memories):
        example = make_example(spec, seed=seed, index=index)
        memory = [tokenizer.decode(chunk.tolist()) for chunk in example["memory"]]
        for question in example["input_ids"]:
            rows.append({"question": tokenizer.decode(question[1:PROMPT_LEN].tolist()), "memory": memory})
            values.append(tokenizer.decode(question[PROMPT_LEN:].tolist(), skip_special_tokens=True))
    return rows, values
