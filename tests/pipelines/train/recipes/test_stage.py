"""The stage recipe's driver-side pieces (pipelines/train/recipes/stage.py), without Ray or DeepSpeed running: an
export's system.json is read back by evaluation as the system that trained; the summary and the needle-by-depth table
a run ends with, from hand-written metrics; the lineage tags; paths resolved and a random pair's checkpoints written
once, before the workers. Training through the recipe: test_stage0.py."""

from __future__ import annotations

import dataclasses
import math

import torch

from pipelines.data.memory_modes import MemoryMode, read_system, system_mode
from pipelines.evaluate.common import needle_spec
from pipelines.train.configs.common import DeepSpeedSettings, ScalingSettings
from pipelines.train.configs.stage import DataConfig, ModelConfig, NeedleConfig, StageConfig
from pipelines.train.presets import STAGE0
from pipelines.train.recipes.stage import (STAGE, compiles_layers, engine_has_gates, lineage_tags, log_evaluation_table,
                                           prepare_paths, with_zero_stage, write_system)


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


def test_base_until_starts_the_mixture_at_the_first_check_that_reaches_the_bar(monkeypatch):
    """needle.base_until 0.9, checked every 100 steps: held-out 0.5 at step 100 keeps the base task, 0.93 at step
    200 starts the mixture there; it stays put (no more checks), the stream follows the state before each step, and
    a resumed state sets a fresh stream before its first step. With no check reaching the bar, base_steps."""
    import pipelines.train.recipes.stage as stage
    from pipelines.train.recipes import TrainState

    measured = {100: 0.5, 200: 0.93}
    checked = []

    def accuracy(model, spec, seed, val_memories, rank, world, mode):
        checked.append(step)
        assert spec == config.needle.spec() and seed == config.needle.seed + 1 and (rank, world) == (0, 1)
        return measured.get(step, 0.0)

    monkeypatch.setattr(stage, "base_accuracy", accuracy)
    monkeypatch.setattr(stage.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(stage.dist, "get_world_size", lambda: 1)
    engine = type("Engine", (), {"module": None})()
    config = dataclasses.replace(STAGE0, needle=dataclasses.replace(STAGE0.needle, base_steps=1000, base_until=0.9))
    stream, state, logged = type("Stream", (), {"mixture_from": None})(), TrainState(), {}
    for step in range(0, 400):
        state.step = step
        if decided := STAGE.before_step(engine, config, state, stream):
            logged[step] = decided
        assert stream.mixture_from == (200 if step >= 200 else None)
    assert checked == [100, 200]
    assert logged == {100: {"base_check_accuracy": 0.5}, 200: {"base_check_accuracy": 0.93, "mixture_from": 200}}
    resumed = type("Stream", (), {"mixture_from": None})()
    STAGE.before_step(engine, config, TrainState(step=300, mixture_from=200), resumed)
    assert resumed.mixture_from == 200 and checked == [100, 200]

    measured.clear()
    state = TrainState()
    for step in range(0, 1001):
        state.step = step
        decided = STAGE.before_step(engine, config, state, stream)
    assert decided == {"mixture_from": 1000} and stream.mixture_from == 1000
    off = dataclasses.replace(config, needle=dataclasses.replace(config.needle, base_until=0.0))
    assert STAGE.before_step(engine, off, TrainState(step=100), stream) == {}


def test_mixture_steps_end_the_run_that_many_steps_after_the_mixture_starts(monkeypatch):
    """needle.mixture_steps 500: before the mixture the state's decay span sits at train.max_steps (the rate held at
    its peak, the run's end still max_steps); once the check at step 200 starts it, [200, 700], and the loop's last
    step is 700. A resumed state keeps its span; without mixture_steps there is none."""
    import pipelines.train.recipes.stage as stage
    from pipelines.train.recipes import TrainState

    monkeypatch.setattr(stage, "base_accuracy", lambda *args: 0.93 if state.step == 200 else 0.5)
    monkeypatch.setattr(stage.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(stage.dist, "get_world_size", lambda: 1)
    engine, stream = type("Engine", (), {"module": None})(), type("Stream", (), {"mixture_from": None})()
    config = dataclasses.replace(STAGE0, needle=dataclasses.replace(STAGE0.needle, base_steps=1000, base_until=0.9,
                                                                    mixture_steps=500),
                                 train=dataclasses.replace(STAGE0.train, max_steps=1500))
    assert config.problems() == []
    state, spans = TrainState(), {}
    while state.step < state.last_step(config.train.max_steps):
        STAGE.before_step(engine, config, state, stream)
        spans.setdefault(tuple(state.decay), state.step)
        state.step += 1
    assert spans == {(1500, 1500): 0, (200, 700): 200} and state.step == 700
    resumed = TrainState(step=600, mixture_from=200, decay=[200, 700])
    STAGE.before_step(engine, config, resumed, stream)
    assert resumed.decay == [200, 700] and resumed.last_step(1500) == 700
    plain = TrainState(step=300)
    STAGE.before_step(engine, dataclasses.replace(config, needle=dataclasses.replace(config.needle, mixture_steps=0)),
                      plain, stream)
    assert plain.decay is None and plain.last_step(1500) == 1500
