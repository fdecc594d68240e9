"""The code_qa suite on a tiny stage-0 corpus whose one repository is held out (the shop of the corpus tests): exact
match per question kind against known answers, `<read>` compliance on constructed generations, memory-attention
accuracy on constructed attention maps, what each system sees, the refusals, and jobs/evaluate.py end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.tracking import MlflowClient

from models import PAIRS, write_random_checkpoints
from pipelines.corpora import build, tasks
from pipelines.data.memory_modes import MemoryMode, read_system
from pipelines.data.streams import prompt_inputs
from pipelines.data.synthetic_needles import NeedleSpec
from pipelines.evaluate import probes
from pipelines.evaluate.code_qa import (CodeQaSuite, chunk_name, code_qa_metrics, evidence_indices, grow_memory,
                                        held_out, read_compliance, score_answer, score_rows, sized_rows, summary_line)
from pipelines.evaluate.common import System, load_system
from pipelines.evaluate.job import EvaluateConfig
from pipelines.evaluate.metrics import evidence_reading
from pipelines.format.shards import shard_record
from pipelines.format.tokenizer import EOS, SPECIAL_IDS, VOCAB_SIZE, cached_tokenizer
from pipelines.train.configs.stage import DataConfig, ModelConfig, StageConfig
from pipelines.train.model import build_model
from pipelines.train.recipes.stage import write_system
from tests.pipelines.corpora.test_tasks import SHOP, SHOP_SETTINGS

ROOT = Path(__file__).resolve().parents[3]
QA_KINDS = {"defines", "params", "method_of", "returns", "raises", "callers", "constant", "section", "definition"}


def build_stage0_corpus(out: Path, source: Path) -> Path:
    """jobs/build_corpus.py --stage 0 on one repository, without Ray (build_unit is what its Ray tasks run), with
    every repository held out (val_fraction 1)."""
    for sub in ("train", "val", "rejects"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    config = build.BuildConfig(stage=0, sources=[str(source)], out=str(out),
                               stage0=tasks.Stage0Settings(**SHOP_SETTINGS, val_fraction=1.0))
    stats = json.loads(build.build_unit(build.stage0_items(config), out=str(out), make_records=tasks.file_records,
                                        make_rows=build.stage0_rows, settings=config.stage0, checkpoint=None))
    (out / "manifest.json").write_text(json.dumps(build.make_manifest(config, [stats], 0.0)))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("code-qa")
    for rel, text in SHOP.items():
        (tmp / "shop" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "shop" / rel).write_text(text)
    return build_stage0_corpus(tmp / "corpus", tmp / "shop")


@pytest.fixture(scope="module")
def rows(corpus) -> list[dict]:
    rows, pools = held_out(CodeQaSuite(corpus=str(corpus), max_rows=1000))
    assert pools == {}  # no size above 1x asked: no pools read
    return rows


@pytest.fixture(scope="module")
def text_root(tmp_path_factory) -> Path:
    """The tiny pair with Qwen3's vocabulary, which reads corpus ids."""
    root = tmp_path_factory.mktemp("text-checkpoints")
    write_random_checkpoints(PAIRS["tiny-text"], root)
    return root


def export_of(directory: Path, text_root: Path, memory: str) -> Path:
    """A (random) corpus-trained export as the stage job writes it: the added weights and its system.json."""
    torch.manual_seed(0)
    config = StageConfig(stage=1, model=ModelConfig(pair="tiny-text", checkpoint_root=str(text_root), memory=memory,
                                                    gca_layers="upper_half", gca_gate_init=0.3, decoder="full"),
                         data=DataConfig(train_path="corpus/train"))
    build_model(config.model).save_pretrained(directory)
    write_system(directory, config)
    return directory


class Answering:
    """A registered version's pyfunc as code_qa calls it (text in, text out), answering from a table."""

    def __init__(self, answer):
        self.answer, self.asked = answer, []

    def predict(self, rows, params=None):
        self.asked += rows
        return [self.answer(row) for row in rows]


def test_known_answers_score_one_per_kind_and_wrong_ones_zero(rows):
    """An oracle that says each row's target is exact on every kind and reads before it answers; one that says
    something else is never exact and never complies."""
    targets = {row["prompt"]: row["target"] for row in rows}
    oracle = Answering(lambda asked: targets[asked["question"]])
    metrics, counts = code_qa_metrics(score_rows(System("oracle", None, MemoryMode(), NeedleSpec(), oracle), rows, 8))
    kinds = {name.split("/")[-1] for name in metrics if name.startswith("code_qa/exact/") and "ci95" not in name}
    assert QA_KINDS <= kinds and any(k.startswith("needle_") for k in kinds), kinds
    assert all(metrics[f"code_qa/exact/{kind}"] == 1.0 for kind in kinds)
    assert metrics["code_qa/exact"] == 1.0 and counts["code_qa/exact"] == len(rows)
    agentic = sum("<read>" in row["target"] for row in rows)
    assert 0 < agentic < len(rows) and counts["code_qa/read_compliance"] == agentic
    assert metrics["code_qa/read_compliance"] == 1.0 and metrics["code_qa/read_compliance/ci95"][1] == 1.0
    assert not any(name.startswith("code_qa/attention/") for name in metrics)  # a pyfunc shows no attention
    assert oracle.asked[0] == {"question": rows[0]["prompt"], "memory": rows[0]["memory"]}

    wrong = Answering(lambda asked: "<read>### nowhere.py [chunk 0]</read>Widget")
    metrics, _ = code_qa_metrics(score_rows(System("wrong", None, MemoryMode(), NeedleSpec(), wrong), rows, 8))
    assert all(metrics[f"code_qa/exact/{kind}"] == 0.0 for kind in kinds)
    assert metrics["code_qa/read_compliance"] == 0.0 and metrics["code_qa/exact/ci95"][0] == 0.0


def test_exact_match_is_the_answer_after_the_reads(rows):
    row = next(r for r in rows if r["kind"] == "method_of" and "<read>" in r["target"])
    reads = row["target"][: row["target"].rindex("</read>") + len("</read>")]
    assert score_answer(row, f"{reads} {row['answer']}\n")["exact"]  # whitespace around the answer is not an error
    assert score_answer(row, row["answer"])["exact"]  # no read: still the right answer (compliance says the rest)
    assert not score_answer(row, f"{reads}{row['answer']}Extra")["exact"]
    assert not score_answer(row, f"{row['answer']}{reads}")["exact"]


EVIDENCE = ["### shop/cart.py [chunk 0]", "### shop/cart.py [chunk 3]"]


@pytest.mark.parametrize("text, complies", [
    ("<read>### shop/cart.py [chunk 3]</read>Cart", True),
    ("<read>### shop/ledger.py [chunk 1]</read> <read>### shop/cart.py [chunk 0]</read>\nCart", True),
    ("<read>### shop/ledger.py [chunk 1]</read>Cart", False),  # a chunk without the evidence
    ("Cart<read>### shop/cart.py [chunk 3]</read>", False),  # read after the answer
    ("Cart<read>### shop/cart.py [chunk 3]</read>Cart", False),  # answered before reading
    ("<read>### shop/cart.py [chunk 3]</read>", False),  # read, never answered
    ("<read>### shop/cart.py [chunk 3]Cart", False),  # a read never closed
    ("Cart", False),
])
def test_read_compliance_on_constructed_generations(text, complies):
    assert read_compliance(text, EVIDENCE) is complies


def test_evidence_reading_on_a_constructed_attention_map():
    """Three chunks of two positions, chunk 1 the evidence: layer A puts 0.6 on it and reads it most, layer B 0.1 and
    reads chunk 0 most; the layer that reads the evidence most (A) is the one reported."""
    chunks = [(0, 2), (2, 4), (4, 6)]
    layer_a = torch.tensor([[0.1, 0.1, 0.3, 0.3, 0.1, 0.1], [0.1, 0.1, 0.3, 0.3, 0.1, 0.1]])  # (heads, positions)
    layer_b = torch.tensor([[0.5, 0.3, 0.1, 0.0, 0.05, 0.05], [0.5, 0.3, 0.0, 0.1, 0.05, 0.05]])
    mass, top = evidence_reading([layer_b, layer_a], chunks, [1])
    assert mass == pytest.approx(0.6) and top is True
    mass, top = evidence_reading([layer_b], chunks, [1])
    assert mass == pytest.approx(0.1) and top is False
    mass, top = evidence_reading([layer_b], chunks, [0, 2])  # two evidence chunks: their mass adds up
    assert mass == pytest.approx(0.9) and top is True


def test_each_system_sees_the_memory_where_it_reads_it(rows):
    row = next(r for r in rows if r["task"] == "code_qa" and len(r["memory_input_ids"]) >= 3)
    prompt = row["input_ids"][: row["labels"].index(next(label for label in row["labels"] if label != -100))]
    gca = prompt_inputs(row, MemoryMode("gca"))
    assert gca["input_ids"][0].tolist() == prompt
    memory, mask = gca["memory_input_ids"][0], gca["memory_attention_mask"][0].bool()  # (chunks, longest chunk)
    chunks = [ids[keep].tolist() for ids, keep in zip(memory, mask)]
    assert chunks == [list(c) for c in row["memory_input_ids"]]  # every chunk whole, none cut
    in_context = prompt_inputs(row, MemoryMode("in_context"))
    assert set(in_context) == {"input_ids"}
    assert in_context["input_ids"][0].tolist() == [t for c in chunks for t in c if t != 0] + prompt
    rag = prompt_inputs(row, MemoryMode("rag", rag_k=1))["input_ids"][0].tolist()
    assert rag[-len(prompt):] == prompt and any(rag[: -len(prompt)] == [t for t in c if t != 0] for c in chunks)
    assert prompt_inputs(row, MemoryMode("none"))["input_ids"][0].tolist() == prompt
    assert [row["memory"][i].split("\n")[0] for i in evidence_indices(row)] == row["evidence_chunks"]


def test_systems_answer_greedily_and_gca_attention_lands_where_the_map_says(rows, text_root, tmp_path, monkeypatch):
    """A gca export's answer is its greedy continuation and its attention scores come from its GCA layers; with the
    attention replaced by a map on the evidence chunk (or off it), the scores are 1 (or 0): the chunks' positions
    in the padded memory are the right ones. A prompt-memory export answers with no attention scores."""
    asked = [r for r in rows if r["task"] == "code_qa"][:2]
    gca_export = export_of(tmp_path / "gca", text_root, "gca")
    gca = load_system("gca", str(gca_export), read_system(gca_export))
    scored = score_rows(gca, asked, max_new_tokens=3)
    inputs = prompt_inputs(asked[0], gca.mode)
    first = gca.model(**inputs).logits[0, -1].argmax().item()  # the greedy first token, after the prompt
    if first != SPECIAL_IDS[EOS] and first < VOCAB_SIZE:
        assert scored[0]["generated"].startswith(cached_tokenizer(None).decode([first]))
    assert all(0 <= r["evidence_mass"] <= 1 and r["top_chunk"] in (0.0, 1.0) for r in scored)

    row = asked[0]
    count, length = inputs["memory_input_ids"].shape[1:]
    on, off = torch.zeros(count * length), torch.zeros(count * length)
    evidence = evidence_indices(row)[0]
    on[evidence * length : evidence * length + 5] = 1.0
    other = next(c for c in range(count) if c not in evidence_indices(row))
    off[other * length : other * length + 5] = 1.0
    for attention, want in ((on, 1.0), (off, 0.0)):
        monkeypatch.setattr(probes, "memory_attention",
                            lambda model, **kw: [attention.expand(1, 2, -1).clone()])  # (1, heads, M)
        (result,) = score_rows(gca, [row], max_new_tokens=1)
        assert result["evidence_mass"] == pytest.approx(want) and result["top_chunk"] == want

    rag_export = export_of(tmp_path / "rag", text_root, "rag")
    rag = load_system("rag", str(rag_export), read_system(rag_export))
    (result,) = score_rows(rag, [row], max_new_tokens=2)
    assert math.isnan(result["evidence_mass"]) and isinstance(result["generated"], str)


def test_a_grown_memory_keeps_the_rows_chunks_in_order_among_other_chunks_of_its_repository(rows):
    """m x the row's chunks: its own, whole and in order, among chunks of the same repository it did not hold (each
    text with its own ids); the evidence is found where it went; the same seed places them the same way."""
    row = next(r for r in rows if r["task"] == "code_qa" and len(r["evidence_chunks"]) == 2)
    own = list(zip(row["memory"], map(list, row["memory_input_ids"])))
    pool = own[:3] + [(f"### other.py [chunk {i}]\ndef f{i}(): pass", [i + 5, i + 6]) for i in range(100)]
    grown = grow_memory(row, pool, 4, np.random.default_rng(7))
    assert len(grown["memory"]) == 4 * len(own) and grown["multiplier"] == 4
    pairs = list(zip(grown["memory"], grown["memory_input_ids"]))
    assert [p for p in pairs if p in own] == own  # the row's own chunks, in their order
    added = [p for p in pairs if p not in own]
    assert len(added) == 3 * len(own) and all(p in pool[3:] for p in added) and len(set(map(str, added))) == len(added)
    assert sorted(grown["memory"][i].split("\n")[0] for i in evidence_indices(grown)) == sorted(row["evidence_chunks"])
    places = [grown["memory"].index(text) for text, _ in own]
    assert places != list(range(places[0], places[0] + len(own)))  # spread among the others, not one block
    assert grow_memory(row, pool, 4, np.random.default_rng(7)) == grown
    assert grow_memory(row, pool, 4, np.random.default_rng(8))["memory"] != grown["memory"]
    assert grow_memory(row, pool, 1, np.random.default_rng(7))["memory"] == row["memory"]


def test_memories_grow_with_their_held_out_repository_as_far_as_it_goes(corpus, rows):
    """The suite's sizes over the corpus: 1x is the rows as held; grown, a memory takes its repository's other chunks
    as they are in the repository (not a needle row's, which carry its needle), as many as the size asks or as the
    repository has (the shop has 23 and a Q&A row holds 16); an oracle is scored at each size apart."""
    suite = CodeQaSuite(corpus=str(corpus), multipliers=[1, 2, 4])
    chosen, pools = held_out(suite)
    assert chosen == rows and set(pools) == {row["unit"] for row in rows} == {"shop"}
    pool = pools["shop"]
    assert len(pool) == len({chunk_name(text) for text, _ in pool}) == 23
    assert not any("special magic number" in text for text, _ in pool)
    first, few = held_out(CodeQaSuite(corpus=str(corpus), multipliers=[2], max_rows=1))
    assert first == rows[:1] and few["shop"] == pool  # a repository's pool is whole, whatever rows are asked
    sized = sized_rows(suite, rows, pools)
    assert [r for r in sized if r["multiplier"] == 1] == [{**r, "multiplier": 1} for r in rows]
    for grown, row in zip((r for r in sized if r["multiplier"] > 1), rows * 2, strict=True):
        others = [text for text, _ in pool if chunk_name(text) not in map(chunk_name, row["memory"])]
        assert len(grown["memory"]) == min(grown["multiplier"] * len(row["memory"]), len(row["memory"]) + len(others))
        assert set(grown["memory"]) - set(row["memory"]) <= set(others)
    targets = {row["prompt"]: row["target"] for row in rows}
    oracle = Answering(lambda asked: targets[asked["question"]])
    metrics, counts = code_qa_metrics(score_rows(System("oracle", None, MemoryMode(), NeedleSpec(), oracle), sized, 8))
    assert metrics["code_qa/exact"] == metrics["code_qa/2x/exact"] == metrics["code_qa/4x/exact"] == 1.0
    assert counts["code_qa/exact"] == counts["code_qa/4x/exact"] == len(rows)
    four = [r for r in sized if r["multiplier"] == 4]
    assert metrics["code_qa/4x/memory_chunks"] == sum(len(r["memory"]) for r in four) / len(four)
    assert "code_qa/memory_chunks" not in metrics
    line = summary_line("oracle", metrics, counts, [1, 2, 4])
    assert line.startswith("oracle: code_qa exact 1.00") and "; code_qa at 4x (" in line
    assert line.index("at 2x") < line.index("at 4x")
    assert "code_qa.multipliers" in " ".join(CodeQaSuite(corpus="c", multipliers=[0]).problems())


def test_refusals_name_the_fix(tmp_path, corpus):
    problems = " ".join(EvaluateConfig(model=["x"], suite=["code_qa"]).problems())
    assert "code_qa.corpus" in problems and "build_corpus.py --stage 0" in problems
    assert "code_qa.tasks" in " ".join(EvaluateConfig(model=["x"], suite=["code_qa"], code_qa=CodeQaSuite(
        corpus="c", tasks=["commit"])).problems())
    assert not EvaluateConfig(model=["x"], suite=["code_qa"], code_qa=CodeQaSuite(corpus="c")).problems()

    def refusal(directory) -> str:
        with pytest.raises(FileNotFoundError) as error:
            held_out(CodeQaSuite(corpus=str(directory)))
        return str(error.value)

    missing = refusal(tmp_path / "nope")
    assert "no such directory" in missing and "build_corpus.py --stage 0" in missing
    assert "not a corpus (no manifest.json)" in refusal(tmp_path)
    only_train = tmp_path / "only-train"
    (only_train / "train").mkdir(parents=True)
    pq.write_table(pa.table({"task": ["code_qa"]}), only_train / "train" / "part-0.parquet")
    manifest = {"stage": 0, "repositories": {"train": ["a", "b"], "val": []},
                "shards": {"train/part-0.parquet": shard_record(only_train / "train" / "part-0.parquet")}}
    (only_train / "manifest.json").write_text(json.dumps(manifest))
    assert "has no val split" in refusal(only_train) and "--stage0.val_fraction" in refusal(only_train)
    (only_train / "manifest.json").write_text(json.dumps({**manifest, "stage": 2}))
    assert "is a stage-2 corpus" in refusal(only_train)
    with pytest.raises(FileNotFoundError, match="no rows of tasks"):
        held_out(CodeQaSuite(corpus=str(corpus), tasks=[]))


@pytest.mark.ray
@pytest.mark.slow
def test_evaluate_job_runs_code_qa_on_held_out_repositories(tmp_path, corpus, text_root):
    """The documented command (docs/evaluation.md) on a gca export and a baseline's, through Ray Data actors:
    results.json, every answer, one line per system, MLflow."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exports = [export_of(tmp_path / memory, text_root, memory) for memory in ("gca", "in_context")]
    out = tmp_path / "eval"
    result = subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "evaluate.py"), "--model", *map(str, exports), "--suite", "code_qa",
         "--code_qa.corpus", str(corpus), "--out", str(out), "--code_qa.max_rows", "6", "--code_qa.max_new_tokens",
         "3", "--code_qa.multipliers", "1", "2", "--tracking_uri", uri],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["systems"]) == {"gca", "in_context"}
    for name, entry in results["systems"].items():
        assert entry["counts"]["code_qa/exact"] == 6 and 0 <= entry["metrics"]["code_qa/exact"] <= 1
        assert len(entry["metrics"]["code_qa/exact/ci95"]) == 2
        answers = [json.loads(line) for line in (out / f"code_qa_{name}.jsonl").read_text().splitlines()]
        assert entry["counts"]["code_qa/2x/exact"] == 6 and entry["metrics"]["code_qa/2x/memory_chunks"] > 0
        assert len(answers) == 12 and all(a["system"] == name for a in answers)
        assert sorted(a["multiplier"] for a in answers) == [1] * 6 + [2] * 6
        assert f"{name}: code_qa exact" in result.stdout and "code_qa at 2x (" in result.stdout
    gca = results["systems"]["gca"]["metrics"]
    assert 0 <= gca["code_qa/attention/evidence_mass"] <= 1 and 0 <= gca["code_qa/attention/top_chunk"] <= 1
    assert "code_qa/attention/evidence_mass" not in results["systems"]["in_context"]["metrics"]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    logged = MlflowClient(uri).get_run(summary["mlflow_run_id"])
    assert logged.data.metrics["gca/code_qa/exact"] == gca["code_qa/exact"]
