"""What the MLflow run records about each checkpoint as Ray Train persists it: its URI on the storage path, its step
and its validation metrics, so a user finds, resumes from or registers any checkpoint from the MLflow UI. The
checkpoint itself stays on the storage path (shared storage on a cluster); nothing of it is copied into MLflow.

On the run, per checkpoint:
- the artifact `checkpoints/step_<step>.json`: {"step", "uri", "export", "metrics" (the report it was saved with),
  "validation" (the latest evaluation's metrics and the step they were measured at)}, kept for every checkpoint ever
  written;
- the tag `checkpoint.<step>` = its URI while it exists (Ray Train deletes all but run.keep_checkpoints; the tag goes
  with it), and `checkpoint.latest` = the newest one's URI (a rerun with the same run.name resumes from it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pyarrow.fs
import ray.train

from pipelines.tracking.tracker import Tracker

RECORDS = "checkpoints"  # the run's artifact directory of checkpoint records
TAG_PREFIX = "checkpoint."
LATEST_TAG = "checkpoint.latest"
EXPORT_DIR = "export"  # where a checkpoint holds its loadable export (pipelines.train.engine writes it)
# a run that averages its weights (train.ema_decay) exports the average, and its final checkpoint the last step's own
# weights here too, so the two can be evaluated side by side
UNAVERAGED_EXPORT_DIR = "export-unaveraged"


def record_name(step: int) -> str:
    return f"{RECORDS}/step_{step:08d}.json"


def step_tag(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def is_validation(key: str) -> bool:
    """Evaluation metrics by their names: needle/token accuracies and validation losses, with and without memory."""
    return "accuracy" in key or "val_loss" in key


def checkpoint_uri(checkpoint: ray.train.Checkpoint) -> str:
    """Where a persisted checkpoint lives: a path on a local or NFS storage_path, else scheme://bucket/path."""
    kind = checkpoint.filesystem.type_name
    return checkpoint.path if kind == "local" else f"{kind}://{checkpoint.path}"


def open_uri(uri: str) -> tuple[pyarrow.fs.FileSystem, str]:
    """The pyarrow filesystem and path of a recorded URI (the filesystems Ray Train's storage_path accepts)."""
    if "://" not in uri:
        return pyarrow.fs.LocalFileSystem(), uri
    return pyarrow.fs.FileSystem.from_uri(uri)


def exists(uri: str) -> bool:
    fs, path = open_uri(uri)
    return fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound


class CheckpointRecorder(ray.train.UserCallback):
    """On the Ray Train controller: after every report that carries a checkpoint (Ray Train has persisted it by then,
    and has deleted those beyond run.keep_checkpoints), records it on the MLflow run. A tracking failure is queued and
    saved to `pending_path`, which the driver retries when it closes the run."""

    def __init__(self, tracking_uri: str | None, run_id: str | None, pending_path: str | Path):
        self.tracking_uri, self.run_id, self.pending_path = tracking_uri, run_id, str(pending_path)
        self.validation: dict[str, Any] = {}  # the latest evaluation: {"step": s, metric: value, ...}
        self._tracker: Tracker | None = None  # made on the controller (an MLflow client does not travel)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tracker": None}

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if not metrics or "step" not in metrics[0]:
            return
        report = metrics[0]  # rank 0's; every rank reports the same step
        evaluated = {k: v for k, v in report.items() if is_validation(k)}
        if evaluated:
            self.validation = {"step": report["step"], **evaluated}
        if checkpoint is None or self.run_id is None:
            return
        tracker = self._tracker = self._tracker or Tracker(self.tracking_uri, self.run_id)
        uri, step = checkpoint_uri(checkpoint), int(report["step"])
        export = f"{uri}/{EXPORT_DIR}"
        tracker.log_dict({"step": step, "uri": uri, "export": export if exists(export) else None,
                          "metrics": report, "validation": self.validation}, record_name(step))
        tracker.set_tags({step_tag(step): uri, LATEST_TAG: uri})
        tracker.delete_tags(self._deleted_checkpoint_tags(tracker))
        tracker.save_pending(self.pending_path)

    def _deleted_checkpoint_tags(self, tracker: Tracker) -> list[str]:
        """The run's checkpoint tags whose checkpoints Ray Train has deleted (run.keep_checkpoints), including those
        of an earlier session of a resumed run."""
        if tracker.pending:  # the server refused the last call: do not wait on it again, prune at the next checkpoint
            return []
        try:
            tags = tracker.client.get_run(self.run_id).data.tags
        except Exception:  # noqa: BLE001 - the server is down: prune at the next checkpoint
            return []
        steps = [key for key in tags if re.fullmatch(rf"{re.escape(TAG_PREFIX)}\d+", key)]
        return [key for key in steps if not exists(tags[key])]
