"""The evaluation suite: RULER-style probes, each system's view of them, the results' arithmetic, and jobs/evaluate.py
end to end (Ray Data actors, results.json, plots, MLflow) on exports of the tiny pair."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipelines.data.memory_modes import MemoryMode, read_system
from pipelines.data.synthetic_needles import BOS, EOS, EQ, NeedleSpec, make_example
from pipelines.evaluate.job import EvaluateConfig, needle_metrics
from pipelines.evaluate.ruler import VARIANTS, as_text, make_probe
from pipelines.evaluate.suites import efficiency_row, score_probe, system_prompts
from pipelines.train.config import ModelConfig, NeedleConfig, StageConfig
from pipelines.train.model import build_model
from pipelines.train.recipes.stage import write_system

ROOT = Path(__file__).resolve().parents[3]
SPEC = NeedleSpec()


def export_of(tmp_path: Path, checkpoint_root: Path, memory: str = "gca") -> Path:
    """A (random) stage-0 export as the stage job writes it: the added weights and its system.json."""
    config = StageConfig(model=ModelConfig(pair="tiny", checkpoint_root=str(checkpoint_root), memory=memory,
                                           gca_layers="upper_half", gca_gate_init=0.3, decoder="full"),
                         needle=NeedleConfig())
    directory = tmp_path / f"export-{memory}"
    build_model(config.model).save_pretrained(directory)
    write_system(directory, config)
    return directory


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("multiplier", [1, 16])
def test_every_answer_stands_in_its_memory_and_the_memory_has_the_asked_size(variant, multiplier):
    probe = make_probe(variant, SPEC, multiplier, seed=3, index=1, hops=3)
    assert probe.memory.shape == (SPEC.chunks * multiplier, SPEC.chunk_len)
    memory = as_text(probe.memory.ravel().tolist())
    for question, refs in zip(probe.questions, probe.references, strict=True):
        assert question[0] == BOS
        for ref in refs:
            assert as_text(ref)[:-1] in memory
        if variant in ("single", "multi_key"):
            assert as_text([question[1], EQ, *refs[0]])[:-1] in memory  # the asked key's own fact
    assert all(0 <= d < 1 for d in probe.depth)
    again = make_probe(variant, SPEC, multiplier, seed=3, index=1, hops=3)
    assert np.array_equal(again.memory, probe.memory)  # offline and deterministic: every system gets the same


def test_single_at_the_training_size_is_the_training_distribution():
    """Same memory shape, facts packed in the same number of fact chunks, questions in the same format."""
    probe = make_probe("single", SPEC, 1, seed=3, index=0)
    example = make_example(SPEC, 3, 0)
    assert probe.memory.shape == example["memory"].shape
    fact_chunks = lambda memory: sum(any(t == EQ for t in chunk) for chunk in memory)  # noqa: E731
    assert fact_chunks(probe.memory) == fact_chunks(example["memory"]) == SPEC.fact_chunks
    assert len(probe.questions) == SPEC.questions and len(probe.questions[0]) == 2


def test_variable_tracking_needs_every_hop():
    probe = make_probe("variable_tracking", SPEC, 1, seed=0, index=0, hops=3)
    memory = probe.memory.ravel().tolist()
    defined = lambda key: [i for i in range(len(memory) - 1) if memory[i] == key and memory[i + 1] == EQ]  # noqa: E731
    key = probe.questions[0][1]
    for _ in range(2):  # ka = kb ; kb = kc ; then kc = d d d
        (at,) = defined(key)
        key = memory[at + 2]
        assert key in range(100, 300)  # another key, not the value yet
    (at,) = defined(key)
    assert memory[at + 2 : at + 2 + SPEC.value_digits] == probe.references[0][0]


def test_systems_see_the_memory_where_they_read_it():
    probe = make_probe("single", SPEC, 4, seed=1, index=0)
    gca = system_prompts(probe, MemoryMode("gca"))
    assert gca["input_ids"].tolist() == probe.questions
    assert gca["memory_input_ids"].shape == (len(probe.questions), *probe.memory.shape)
    in_context = system_prompts(probe, MemoryMode("in_context"))
    assert in_context["input_ids"].shape[1] == probe.memory.size + 2 and "memory_input_ids" not in in_context
    rag = system_prompts(probe, MemoryMode("rag", rag_k=1))
    for row, question, refs in zip(rag["input_ids"].tolist(), probe.questions, probe.references, strict=True):
        assert as_text([question[1], EQ, *refs[0]])[:-1] in as_text(row[:-2])  # BM25 found the fact's chunk
    assert system_prompts(probe, MemoryMode("none"))["input_ids"].tolist() == probe.questions


def test_needle_metrics_count_rates_intervals_and_the_heatmap():
    rows = [{"variant": "single", "multiplier": 1, "exact": e, "score": float(e), "depth_bin": b}
            for e, b in [(True, 0), (True, 0), (False, 1), (True, 1)]]
    rows += [{"variant": "multi_value", "multiplier": 4, "exact": False, "score": 0.5, "depth_bin": 0}] * 2
    metrics, counts, heatmap = needle_metrics(rows, SPEC, depth_bins=2)
    assert metrics["needle/single/1x"] == 0.75 and counts["needle/single/1x"] == 4
    low, high = metrics["needle/single/1x/ci95"]
    assert low < 0.75 < high
    assert metrics["needle/multi_value/4x"] == 0.0 and metrics["needle/multi_value/4x/string_match"] == 0.5
    assert heatmap == {"memory_tokens": [SPEC.chunks * SPEC.chunk_len], "accuracy_by_depth": [[1.0], [0.5]]}


@pytest.mark.parametrize("memory", ["gca", "in_context", "rag", "none"])
def test_a_system_scores_probes_and_is_timed(tmp_path, checkpoint_root, memory):
    from pipelines.evaluate.job import load_system

    export = export_of(tmp_path, checkpoint_root, memory)
    system = load_system(memory, str(export), read_system(export))
    assert system.mode.kind == memory and system.spec == SPEC
    rows = score_probe(system, "multi_value", 4, seed=0, index=0)
    assert len(rows) == SPEC.questions and all(0 <= r["score"] <= 1 for r in rows)
    assert {r["memory_tokens"] for r in rows} == {4 * SPEC.chunks * SPEC.chunk_len}
    row = efficiency_row(system, 480, decode_tokens=3, repeats=1)
    assert row["ttft_s"] > 0 and row["decode_s_per_token"] >= 0
    assert row["prompt_tokens"] == {"gca": 2, "none": 2, "in_context": 482, "rag": 2 * SPEC.chunk_len + 2}[memory]


def test_answers_are_the_models_greedy_continuation(tmp_path, checkpoint_root):
    """A probe's answer is transformers' greedy decoding, cut at EOS, and its score is RULER's string match."""
    from pipelines.evaluate.job import load_system
    from pipelines.evaluate.suites import answer_probe

    export = export_of(tmp_path, checkpoint_root, "gca")
    system = load_system("gca", str(export), read_system(export))
    probe = make_probe("single", SPEC, 1, seed=0, index=0)
    answers = answer_probe(system, probe)
    inputs = system_prompts(probe, system.mode)
    step = system.model(**inputs).logits[:, -1].argmax(-1)
    assert [a[0] if a else EOS for a in answers] == step.tolist()  # the first token: the argmax after the prompt
    rows = score_probe(system, "single", 1, seed=0, index=0)
    want = [float(as_text(refs[0])[:-1] in as_text(answer)) for answer, refs in zip(answers, probe.references)]
    assert [r["score"] for r in rows] == want


def test_config_errors_name_the_field():
    assert "suite 'bogus' is not one of" in " ".join(EvaluateConfig(model=["x"], suite=["needle,bogus"]).problems())
    assert "model: name at least one system" in EvaluateConfig().problems()[0]
    code_qa = " ".join(EvaluateConfig(model=["x"], suite=["code_qa"]).problems())
    assert "code_qa.corpus" in code_qa, code_qa  # a suite that needs a corpus says which flag names it


@pytest.mark.ray
def test_evaluate_job_writes_results_plots_and_mlflow(tmp_path, checkpoint_root):
    """The issue's command on a stage-0 export and a baseline's, through Ray Data actors; the training run gets the
    metrics too when the model is named by run id."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    gca = export_of(tmp_path, checkpoint_root, "gca")
    client = MlflowClient(uri)
    experiment = client.create_experiment("stage0")
    run = client.create_run(experiment)
    client.log_artifacts(run.info.run_id, str(export_of(tmp_path, checkpoint_root, "rag")), "export")
    client.set_terminated(run.info.run_id)
    out = tmp_path / "eval"
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "evaluate.py"), "--model", str(gca), run.info.run_id,
         "--suite", "needle,efficiency", "--out", str(out), "--needle.memories", "2", "--needle.multipliers", "1", "4",
         "--needle.variants", "single", "variable_tracking", "--needle.hops", "2", "--efficiency.memory_tokens", "96",
         "480", "--efficiency.repeats", "1", "--efficiency.encoder_chunks", "16", "--tracking_uri", uri],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    results = json.loads((out / "results.json").read_text())
    assert set(results["systems"]) == {"gca", "rag"} == set(summary["systems"])
    for name, entry in results["systems"].items():
        metrics = entry["metrics"]
        for size in ("1x", "4x"):
            assert 0 <= metrics[f"needle/single/{size}"] <= 1
            assert entry["counts"][f"needle/single/{size}"] == 2 * SPEC.questions
            assert 0 <= metrics[f"needle/variable_tracking_2/{size}"] <= 1
        assert len(metrics["needle/single/1x/ci95"]) == 2
        assert metrics["efficiency/ttft_s/96"] > 0 and metrics["efficiency/ttft_s/480"] > 0
    assert results["systems"]["gca"]["metrics"]["efficiency/encoder_chunks_per_s"] > 0
    assert results["heatmaps"]["gca"]["memory_tokens"] == [96, 384]
    for picture in ("needle_heatmap_gca.png", "needle_heatmap_rag.png", "needle_accuracy_by_size.png",
                    "ttft_by_memory_size.png"):
        assert (out / picture).stat().st_size > 1000, picture
    logged = client.get_run(summary["mlflow_run_id"])
    assert logged.data.metrics["gca/needle/single/1x"] == results["systems"]["gca"]["metrics"]["needle/single/1x"]
    assert {a.path for a in client.list_artifacts(logged.info.run_id)} >= {"results.json", "needle_accuracy_by_size.png"}
    trained = client.get_run(run.info.run_id)  # the evaluated training run carries its own results
    assert trained.data.metrics["eval/needle/single/4x"] == results["systems"]["rag"]["metrics"]["needle/single/4x"]
    assert trained.data.tags["eval.run_id"] == logged.info.run_id
    assert not [line for line in result.stdout.splitlines() if "Running Dataset" in line or "%|" in line]


def test_evaluate_refuses_a_missing_model_with_exit_2(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "jobs" / "evaluate.py"), "--model", str(tmp_path / "nope"),
                             "--track", "false", "--out", str(tmp_path / "o")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "not an export directory, a run id" in result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["error"]


def test_memory_attention_reads_the_gca_attention_on_the_evidence_chunks(tmp_path, checkpoint_root):
    """The probed attention is the one the GCA block used (its weighted values are the block's output before o_proj),
    and the evidence chunks are where each question's facts are."""
    from pipelines.evaluate.job import load_system
    from pipelines.evaluate.suites import memory_attention

    export = export_of(tmp_path, checkpoint_root, "gca")
    system = load_system("gca", str(export), read_system(export))
    probe = make_probe("multi_value", SPEC, 4, seed=2, index=0)
    for question, refs, evidence in zip(probe.questions, probe.references, probe.evidence, strict=True):
        text = " ".join(as_text(probe.memory[c].tolist()) for c in evidence)
        assert all(as_text([question[1], EQ, *ref])[:-1] in text for ref in refs)  # both facts, in those chunks
    read = memory_attention(system, probe)
    assert len(read) == len(probe.questions)
    assert all(0 <= r["evidence_mass"] <= 1 and r["top_chunk"] in (0.0, 1.0) for r in read)
    block = next(iter(system.model.gca_blocks().values()))
    assert not block.probe_attention and block.last_attention is None  # the probe is switched off again

    import torch

    from models.gca import MemoryPadding

    torch.manual_seed(0)
    hidden = torch.randn(2, 3, system.model.decoder.config.hidden_size)
    states = torch.randn(2, 5, system.model.decoder.config.hidden_size)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    memory = block.project_memory(states, MemoryPadding.from_mask(mask))
    block.probe_attention = True
    attended = block._attend(block.input_norm(hidden), memory)
    probs = block.last_attention  # (B, H, T, M)
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[:-1]))
    assert float(probs[0, :, :, 3:].abs().max()) == 0.0  # padded memory gets no attention
    value = memory.value.repeat_interleave(block.num_heads // block.num_kv_heads, dim=1)  # (B, H, M, hd)
    mixed = (probs @ value).transpose(1, 2).reshape(2, 3, -1)
    assert torch.allclose(block.o_proj(mixed), attended, atol=1e-5)
