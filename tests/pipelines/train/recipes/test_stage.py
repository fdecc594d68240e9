"""The stage recipe's driver-side pieces (pipelines/train/recipes/stage.py), without Ray or DeepSpeed running: an
export's system.json is read back by evaluation as the system that trained; the summary and the needle-by-depth table
a run ends with, from hand-written metrics; the lineage tags; paths resolved and a random pair's checkpoints written
once, before the workers. Training through the recipe: test_stage0.py."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import torch

from models import AwarenessModel, MemoryReading
from pipelines.data.memory_modes import MemoryMode, read_system, system_mode
from pipelines.data.synthetic_needles import make_batch
from pipelines.evaluate.common import needle_spec
from pipelines.train.configs.common import DeepSpeedSettings, ScalingSettings
from pipelines.train.configs.stage import DataConfig, ModelConfig, NeedleConfig, StageConfig
from pipelines.train.model import build_model
from pipelines.train.presets import STAGE0
from pipelines.train.recipes.stage import (STAGE, compiles_layers, engine_has_gates, lineage_tags, log_evaluation_table,
                                           prepare_paths, with_zero_stage, write_system)
from tests.conftest import open_gates


def test_a_dense_rag_export_carries_its_retriever(tmp_path):
    """The retriever is copied into the export and read back from there: the export (and a registered copy of it)
    holds everything the reader reads with, wherever the retriever's own run was stored."""
    retriever = tmp_path / "elsewhere" / "export"
    retriever.mkdir(parents=True)
    (retriever / "retriever.json").write_text('{"attention": "bidirectional"}')
    (retriever / "model.safetensors").write_bytes(b"weights")
    write_system(tmp_path / "reader", StageConfig(model=ModelConfig(memory="dense_rag", retriever=str(retriever))))
    moved = tmp_path / "moved"
    (tmp_path / "reader").rename(moved)  # as a registered copy moves: nothing points back at the run
    mode = system_mode(read_system(moved))
    assert mode.kind == "dense_rag" and mode.retriever == str(moved / "retriever")
    assert (moved / "retriever" / "model.safetensors").read_bytes() == b"weights"
    assert mode.problems() == []


def test_system_json_reads_back_as_the_trained_system(tmp_path):
    needles = StageConfig(model=ModelConfig(memory="rag", rag_k=3, context_budget=512),
                          needle=NeedleConfig(facts=4, questions=2, chunk_len=16))
    write_system(tmp_path, needles)
    system = read_system(tmp_path)
    assert system_mode(system) == MemoryMode("rag", context_budget=512, rag_k=3)
    assert needle_spec(system) == needles.needle.spec()  # evaluation asks the needle task it learned
    corpus = dataclasses.replace(needles, data=DataConfig(train_path="/corpus/train"))
    write_system(tmp_path, corpus)
    assert read_system(tmp_path)["needle"] is None  # a corpus-trained system learned no needle task


class Tracker:
    def __init__(self):
        self.calls = []

    def log_artifacts(self, directory, artifact_path):
        self.calls.append(("log_artifacts", str(directory), artifact_path))

    def log_table(self, data, name):
        self.calls.append(("log_table", data, name))


def test_the_summary_and_the_needle_table_from_hand_written_metrics():
    metrics = {"needle_accuracy": 0.9, "no_memory_accuracy": 0.1, "gate_abs_mean": 0.5, "examples_seen": 64,
               "index_checksum": 2016, "needle_accuracy/depth_1": 0.75, "needle_accuracy/depth_0": 1.0, "val_loss": 2.0,
               "needle_val_loss": 1.5, "no_memory_val_loss": 3.0, "needle_accuracy/8x": 0.8,
               "needle_accuracy/multi_value": 0.7}
    tracker = Tracker()
    summary = STAGE.summary(STAGE0, metrics, "/runs/x/export", tracker)
    assert summary == {"pair": "tiny-shared", "memory": "gca", "fusion": "gca", "needle_accuracy": 0.9,
                       "needle_accuracy/8x": 0.8, "needle_accuracy/multi_value": 0.7,  # not the depths
                       "no_memory_accuracy": 0.1, "gate_abs_mean": 0.5, "gate_abs_init": math.tanh(0.3),
                       "needle_val_loss": 1.5, "no_memory_val_loss": 3.0, "examples_seen": 64, "index_checksum": 2016,
                       "export": "/runs/x/export"}  # no corpus metrics
    assert tracker.calls == [("log_artifacts", "/runs/x/export", "export"),
                             ("log_table", {"depth_bin": [0, 1], "needle_accuracy": [1.0, 0.75]},
                              "eval/needle_by_depth.json")]
    baseline = dataclasses.replace(STAGE0, model=dataclasses.replace(STAGE0.model, memory="none"),
                                   data=dataclasses.replace(STAGE0.data, train_path="/corpus/train"))
    summary = STAGE.summary(baseline, {"val_loss": 2.0}, None, tracker := Tracker())
    assert summary["gate_abs_init"] is None and summary["val_loss"] == 2.0 and summary["token_accuracy"] is None
    assert tracker.calls == []  # no export, no depth metrics
    log_evaluation_table(tracker, {"needle_accuracy": 1.0})
    assert tracker.calls == []
    assert engine_has_gates(STAGE0) and not engine_has_gates(baseline)
    cross = dataclasses.replace(STAGE0, model=dataclasses.replace(STAGE0.model, fusion="cross"))
    assert not engine_has_gates(cross)


def test_lineage_tags_and_prepared_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = StageConfig(model=ModelConfig(pair="tiny", checkpoint_root="ckpt"),
                         data=DataConfig(train_path="corpus/train"),
                         run=dataclasses.replace(STAGE0.run, storage_path="runs"))
    prepared = prepare_paths(config)
    root = tmp_path / "ckpt"
    assert prepared.model.checkpoint_root == str(root) and prepared.run.storage_path == str(tmp_path / "runs")
    assert prepared.data.train_path == str(tmp_path / "corpus" / "train")
    assert (root / "tiny-qwen3" / "config.json").is_file() and (root / "tiny-qwen3-encoder" / "config.json").is_file()
    tags = lineage_tags(prepared)
    assert (tags["pair"], tags["decoder"], tags["encoder"]) == ("tiny", "tiny-qwen3", "tiny-qwen3-encoder")
    assert tags["base.decoder"] == str(root / "tiny-qwen3") and tags["base.encoder"] == str(root / "tiny-qwen3-encoder")
    assert tags["data.manifest_hash"] == "missing" and "init_from" not in tags  # no corpus there yet
    assert tags["git.commit"] and "sys.python" in tags


def test_a_stage_job_takes_the_plans_stage_on_gpus_and_zero3_on_cpu_workers():
    gpu = StageConfig(model=ModelConfig(pair="scale"), scaling=ScalingSettings(num_workers=1, use_gpu=True))
    assert StageConfig().deepspeed.zero_stage is None  # the stage jobs' default: chosen
    assert with_zero_stage(gpu).deepspeed.zero_stage == 2
    assert with_zero_stage(StageConfig()).deepspeed.zero_stage == 3
    given = StageConfig(deepspeed=DeepSpeedSettings(zero_stage=1))
    assert with_zero_stage(given) is given


def test_layers_compile_only_when_asked():
    gpu = ScalingSettings(num_workers=1, use_gpu=True)
    assert not compiles_layers(StageConfig(scaling=gpu, deepspeed=DeepSpeedSettings(zero_stage=2)))
    assert not compiles_layers(StageConfig(scaling=gpu, deepspeed=DeepSpeedSettings(zero_stage=3)))
    assert not compiles_layers(StageConfig(deepspeed=DeepSpeedSettings(zero_stage=2)))  # CPU workers
    assert compiles_layers(StageConfig(model=ModelConfig(compile=True), deepspeed=DeepSpeedSettings(zero_stage=3)))


def test_liger_kernels_are_refused_on_cpu_workers_and_absent_here():
    from models.kernels import liger_available, use_liger_kernels

    problems = StageConfig(model=ModelConfig(liger=True)).problems()
    assert any("model.liger" in p and "--scaling.use_gpu true" in p for p in problems)
    if not torch.cuda.is_available():  # nothing patched where Liger cannot run
        assert not liger_available() and use_liger_kernels() is False


def base_top_k_config(checkpoint_root, **needle) -> StageConfig:
    """A routed tiny model (4 chunks a query) whose first 3 steps read 2 chunks a query."""
    reading = MemoryReading(top_k=4, chunk_weights="router", lexical_routing=3.0)
    return StageConfig(model=ModelConfig(pair="tiny", checkpoint_root=str(checkpoint_root), decoder="full",
                                         encoder="full", gca_layers="upper_half", reading=reading),
                       needle=NeedleConfig(base_steps=3, base_top_k=2, variants=["single", "multi_key"],
                                           memory_scale_max=2, **needle))


def test_the_base_steps_read_base_top_k_chunks_and_the_rest_as_built(checkpoint_root, tmp_path):
    """needle.base_top_k: a base step's forward equals a model built with k = 2 on the same weights (routed: the
    base memory's 4 chunks are no longer all read), a later step's a model built with k = 4; the reading is set from
    the step alone, so a run resumed at any step reads as the uninterrupted one, and the export keeps the built k."""
    config = base_top_k_config(checkpoint_root)
    torch.manual_seed(0)
    model = open_gates(build_model(config.model)).eval()
    reference = build_model(dataclasses.replace(config.model, reading=config.model.reading.with_top_k(2))).eval()
    reference.load_state_dict(model.state_dict())
    engine = SimpleNamespace(module=model)
    batch = make_batch(config.needle.spec().at_step(0), 0, [0, 1])
    assert batch["memory_input_ids"].shape[1] == 4  # the base size: 4 chunks, all read with k = 4
    inputs = {k: batch[k] for k in ("input_ids", "labels", "memory_input_ids")}
    with torch.no_grad():
        built = model(**inputs).logits
        for step, k in [(0, 2), (2, 2), (3, 4), (7, 4), (1, 2), (5, 4)]:  # resumed before, at and after the switch
            STAGE.at_step(engine, config, step)
            assert model.reading.top_k == k, step
            logits = model(**inputs).logits
            if k == 2:
                torch.testing.assert_close(logits, reference(**inputs).logits)
                assert not torch.allclose(logits, built, atol=1e-4)
            else:
                torch.testing.assert_close(logits, built)
        STAGE.at_step(engine, config, 0)
    model.save_pretrained(tmp_path / "export")
    assert AwarenessModel.from_pretrained(tmp_path / "export").reading.top_k == 4
    unset = dataclasses.replace(config, needle=dataclasses.replace(config.needle, base_top_k=None))
    STAGE.at_step(engine, unset, 0)  # not asked: the model reads as it is
    assert model.reading.top_k == 2


def test_base_top_k_is_refused_where_it_would_mean_nothing(checkpoint_root):
    config = base_top_k_config(checkpoint_root)
    assert config.problems() == []
    no_base = dataclasses.replace(config, needle=dataclasses.replace(config.needle, base_steps=0))
    assert any("needle.base_top_k (2)" in p and "--needle.base_steps" in p for p in no_base.problems())
    zero = dataclasses.replace(config, needle=dataclasses.replace(config.needle, base_top_k=0))
    assert any("give k >= 1" in p for p in zero.problems())
    unrouted = dataclasses.replace(config, model=dataclasses.replace(config.model, reading=MemoryReading()))
    assert any("--model.memory_top_k K" in p for p in unrouted.problems())
    rag = dataclasses.replace(config, model=dataclasses.replace(config.model, memory="rag"))
    assert any("needle.base_top_k" in p for p in rag.problems())
