"""What the serving tests share: a tiny export with open gates (so the memory changes the answer) on a stage-like
MLflow run, registered."""

from __future__ import annotations

from pathlib import Path

import torch
from mlflow.tracking import MlflowClient

from models import AwarenessModel, build_pair
from pipelines.serving.register import register_run


def register_tiny_export(tmp: Path, checkpoint_root, tracking_uri: str, experiment_name: str, name: str,
                         tags: dict[str, str] | None = None) -> tuple[AwarenessModel, object, str]:
    """(the model, its registered version, the run id)."""
    torch.manual_seed(0)
    model = build_pair("tiny", checkpoint_root=checkpoint_root, gca_layers="upper_half").eval()
    with torch.no_grad():
        for block in model.gca_blocks().values():
            block.gate.fill_(2.0)
    model.save_pretrained(tmp / "export")
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment_name)
    experiment = found.experiment_id if found else client.create_experiment(experiment_name)
    run = client.create_run(experiment, tags={"pair": "tiny", **(tags or {})})
    for key, value in {"model.pair": "tiny", "needle.value_digits": "3", "data.train_path": "None"}.items():
        client.log_param(run.info.run_id, key, value)
    client.log_artifacts(run.info.run_id, str(tmp / "export"), "export")
    version = register_run(run.info.run_id, tracking_uri=tracking_uri, name=name)
    return model, version, run.info.run_id
