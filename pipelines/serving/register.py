"""Registering a stage job's run: its export (or a checkpoint's) logged as the Awareness pyfunc into the run and made
a version of the registered model, with the run's lineage as tags (pipelines.tracking.registry does the MLflow part)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pyarrow.fs
from mlflow.tracking import MlflowClient

from models import AwarenessConfig
from pipelines.format.tokenizer import EOS
from pipelines.serving.pyfunc import ENTRY, PLACEMENT, ensure_tokenizer, signature
from pipelines.tracking.checkpoints import open_uri
from pipelines.tracking.registry import (DEFAULT_NAME, MODEL_ARTIFACT, checkpoint_record, lineage_tags, log_pyfunc,
                                         pinned_requirements, register_version)
from pipelines.tracking.tracker import resolve_tracking_uri


def register_run(run_id: str, *, tracking_uri: str | None = None, name: str = DEFAULT_NAME, alias: str = "candidate",
                 sweep_run_id: str | None = None, max_new_tokens: int | None = None, step: int | None = None):
    """Logs the run's `export/` artifact (or, with `step`, the export inside that step's checkpoint, found through
    the run's checkpoint record) as a pyfunc model into that run and registers it. Returns the ModelVersion. The
    model references the base checkpoints the export names; they must exist where it is loaded."""
    uri = resolve_tracking_uri(tracking_uri)
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    artifact, checkpoint_tags = MODEL_ARTIFACT, {}
    with tempfile.TemporaryDirectory() as tmp:
        if step is None:
            export = Path(_download_export(client, run_id, tmp))
        else:
            record = checkpoint_record(client, run_id, step, tmp)
            export = _copy_export(record, Path(tmp) / "checkpoint-export")
            artifact = f"{MODEL_ARTIFACT}/step_{step}"
            checkpoint_tags = {"checkpoint.step": str(step), "checkpoint.uri": record["uri"]}
        config = AwarenessConfig.load(export)
        ensure_tokenizer(config.decoder)
        settings = {"max_new_tokens": max_new_tokens or _answer_length(run.data.params), **_answer_end(run.data.params),
                    **PLACEMENT}
        log_pyfunc(client, run_id, ENTRY, {"export": str(export)}, signature(),
                   settings, _requirements(), artifact)
    tags = lineage_tags(run, config, sweep_run_id) | checkpoint_tags
    at = f", checkpoint of step {step}: {checkpoint_tags['checkpoint.uri']}" if step is not None else ""
    return register_version(client, name, run, artifact, tags, f"run {run.info.run_name} ({run_id}){at}", alias)


def _copy_export(record: dict[str, Any], destination: Path) -> Path:
    """A checkpoint's export/ from the storage path (local, NFS, or a bucket through pyarrow) to a local directory."""
    fs, path = open_uri(record["export"])
    destination.mkdir(parents=True, exist_ok=True)
    pyarrow.fs.copy_files(path, str(destination), source_filesystem=fs,
                          destination_filesystem=pyarrow.fs.LocalFileSystem())
    return destination


def _download_export(client, run_id: str, directory: str) -> str:
    names = {a.path for a in client.list_artifacts(run_id)}
    if "export" not in names:
        raise FileNotFoundError(
            f"MLflow run {run_id} has no 'export' artifact (it has {sorted(names)}): register a run that trained to "
            f"its last step (a stage job's run, or a sweep trial that was not stopped early)"
        )
    return client.download_artifacts(run_id, "export", directory)


def _answer_length(params: dict[str, str]) -> int:
    """Needle runs answer value_digits + EOS; otherwise a generic default."""
    digits, corpus = params.get("needle.value_digits"), params.get("data.train_path", "None")
    return int(digits) + 1 if digits and corpus in ("None", "") else 32


def _answer_end(params: dict[str, str]) -> dict[str, Any]:
    """How answers end and read: corpus rows end every target with <|im_end|> and may answer in agentic tokens
    (<plan>, <read>, <edit>), kept in the text; needles end with <eos>; a real pair's own checkpoint decides."""
    if params.get("data.train_path", "None") not in ("None", ""):
        return {"eos_token": EOS, "skip_special_tokens": False}
    return {"eos_token": "<eos>" if params.get("model.pair", "").startswith(("tiny", "small")) else None}


def _requirements() -> list[str]:
    """Stated, not inferred (inference imports and times every module): what the model's code imports at load."""
    return pinned_requirements("torch", "transformers", "tokenizers", "peft", "safetensors", "numpy",
                               "bm25s")  # bm25s: a rag baseline's retrieval
