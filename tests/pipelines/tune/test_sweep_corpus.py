"""A 2-trial stage-1 sweep on 2 CPUs, on a commit corpus built from a git history made here, against a real
`mlflow server`: both trials train on the shards and report val_loss, ASHA ranks them on it, and the best is
registered with the corpus's manifest hash; its pyfunc model takes text through the Qwen3 tokenizer and answers
exactly as AwarenessModel.generate does on the same ids."""

from __future__ import annotations

import hashlib
import math
import time

import pyarrow.parquet as pq
import pytest
import torch

from models import AwarenessModel
from pipelines.format.tokenizer import EOS, SPECIAL_IDS, QwenTokenizer
from tests.pipelines.train.test_stage_commits import build_commit_corpus

# every test here starts Ray; ~80 s of a 2-trial sweep, in `make test-slow` (test_sweep.py keeps a sweep in `make test`)
pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS, EVAL_EVERY = 4, 2


def manifest_hash(split) -> str:
    """What lineage must record: the sha256 of the manifest jobs/build_corpus.py wrote beside the split."""
    return hashlib.sha256((split.parent / "manifest.json").read_bytes()).hexdigest()[:16]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_commit_corpus(tmp_path_factory.mktemp("commits"))


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, corpus, checkpoint_root, mlflow_server):
    import ray

    from jobs.sweep import main

    tmp = tmp_path_factory.mktemp("sweep-stage1")
    patch = pytest.MonkeyPatch()
    patch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    started = time.perf_counter()
    try:
        summary = main([
            "--stage", "1", "--sweep.num_samples", "2", "--sweep.lora_ranks", "4", "8",
            "--sweep.placements", "upper_half", "1,3", "--sweep.grace_period", "1", "--sweep.name", "text-sweep",
            "--data.train_path", str(corpus), "--data.val_path", str(corpus), "--data.max_tokens", "1024",
            "--data.max_chunks", "4", "--data.val_examples", "4",
            "--train.max_steps", str(STEPS), "--train.eval_every", str(EVAL_EVERY), "--train.log_every", "2",
            "--train.checkpoint_every", str(STEPS), "--train.memories_per_step", "2",
            "--train.frozen_decoder_steps", "1", "--train.warmup_steps", "1",
            "--model.checkpoint_root", str(checkpoint_root), "--run.storage_path", str(tmp / "ray"),
        ])
    finally:
        ray.shutdown()  # only this test's local instance; never `ray stop`
        patch.undo()
    summary["test_wall_seconds"] = time.perf_counter() - started
    print(f"stage-1 sweep: {summary['wall_seconds']:.0f} s in Tune, {summary['test_wall_seconds']:.0f} s with "
          f"start-up and registration, {summary['max_concurrent_trials']} trials at once")
    return summary


def test_both_trials_train_on_the_corpus_and_report_val_loss(sweep, corpus, mlflow_server):
    from mlflow.tracking import MlflowClient

    assert sweep["stage"] == 1 and sweep["pair"] == "tiny-text"
    assert sweep["trials"] == 2 and sweep["max_concurrent_trials"] == 2  # min(2 samples, 2 CPUs / (0.1 + 0.4))
    client = MlflowClient(mlflow_server.uri)
    parent = client.get_run(sweep["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and "best_val_loss" in parent.data.metrics
    table = open(client.download_artifacts(parent.info.run_id, "sweep/table.md")).read()
    assert "| val_loss | token_accuracy | no_memory_val_loss |" in table.splitlines()[0]
    assert "sweep_rank_x_placement.png" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    manifest = manifest_hash(corpus)
    for row in sweep["table"]:
        assert row["error"] is None and math.isfinite(row["val_loss"]) and row["val_loss"] > 0
        assert f"| {row['lora_rank']} | {row['placement']} |" in table
        child = client.get_run(row["mlflow_run_id"])
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["data.manifest_hash"] == manifest and child.data.params["data.train_path"] == str(corpus)
        assert child.data.params["model.lora_rank"] == str(row["lora_rank"]) and child.data.params["stage"] == "1"
        evaluated = [m.step for m in client.get_metric_history(child.info.run_id, "val_loss")]
        assert evaluated[0] == EVAL_EVERY and row["steps"] <= evaluated[-1]
        if not row["stopped_early"]:
            assert row["steps"] == STEPS and evaluated == [EVAL_EVERY, STEPS] and row["export"]


def test_best_trial_is_registered_with_the_corpus_lineage(sweep, corpus, mlflow_server):
    from mlflow.tracking import MlflowClient

    best = sweep["best"]
    assert best["val_loss"] == min(r["val_loss"] for r in sweep["table"] if not r["stopped_early"])
    version = MlflowClient(mlflow_server.uri).get_model_version_by_alias("awareness", "candidate")
    assert version.version == sweep["registered"]["version"] and version.run_id == best["mlflow_run_id"]
    assert version.tags["sweep_run_id"] == sweep["mlflow_run_id"]
    assert version.tags["stage"] == "1" and version.tags["pair"] == "tiny-text"
    assert version.tags["data.manifest_hash"] == manifest_hash(corpus)
    assert version.tags["base.decoder"].endswith("tiny-qwen3-text")


def test_registered_model_answers_text_as_generate_does(sweep, corpus, mlflow_server, monkeypatch):
    """A corpus row's prompt and memory texts go in: the ids the pyfunc builds are the row's training ids, and the
    answer is generate's continuation, cut at <|im_end|>, decoded by the same tokenizer.json."""
    import mlflow
    from tokenizers import Tokenizer

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)  # not mlflow.set_tracking_uri: no global left behind
    pyfunc = mlflow.pyfunc.load_model("models:/awareness@candidate")
    row = next(r for r in pq.read_table(corpus).to_pylist() if r["variant"] == "hinted")
    prompt = row["input_ids"][: row["labels"].count(-100)]
    memory = row["memory"][:4]
    inputs = pyfunc.unwrap_python_model().encode(row["prompt"], memory)
    assert inputs["input_ids"][0].tolist() == prompt  # text -> the very ids stage 1 trained on
    for chunk, ids, mask in zip(row["memory_input_ids"][:4], inputs["memory_input_ids"][0],
                                inputs["memory_attention_mask"][0], strict=True):
        assert ids[mask.bool()].tolist() == chunk

    tokenizer = Tokenizer.from_file(f"{pyfunc.unwrap_python_model().model.config.decoder}/tokenizer.json")
    assert tokenizer.encode(QwenTokenizer().decode(prompt)).ids == prompt  # ids round-trip through the text
    answer = pyfunc.predict({"question": row["prompt"], "memory": memory}, params={"max_new_tokens": 8})
    model = AwarenessModel.from_pretrained(sweep["best"]["export"]).eval()  # the trial's export, from its run
    out = model.generate(torch.tensor([prompt]), memory_input_ids=inputs["memory_input_ids"],
                         memory_attention_mask=inputs["memory_attention_mask"], max_new_tokens=8, do_sample=False,
                         eos_token_id=SPECIAL_IDS[EOS], pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    new = new[: new.index(SPECIAL_IDS[EOS])] if SPECIAL_IDS[EOS] in new else new
    assert isinstance(answer[0], str) and answer == [tokenizer.decode(new, skip_special_tokens=False)]
    assert answer[0] == QwenTokenizer().decode(new)  # the corpus tokenizer reads the same text
