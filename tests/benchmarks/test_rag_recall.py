"""benchmarks/rag_recall.py as its docstring shows it: the share of needle questions whose evidence chunks all lie in
BM25's top k, against a count made here by hand from the same probes and the same retrieval; the default run covers
every task and size."""

import json
import subprocess
import sys
from pathlib import Path

from pipelines.data.memory_modes import top_chunks
from pipelines.evaluate.needle import NeedleSuite, make_probe
from pipelines.train.presets import STAGE0

ROOT = Path(__file__).resolve().parents[2]


def test_recall_is_the_share_of_questions_whose_evidence_bm25_keeps():
    done = subprocess.run([sys.executable, "benchmarks/rag_recall.py", "--k", "1", "--multipliers", "1", "4",
                           "--variants", "single", "variable_tracking", "--memories", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(summary["recall"]) == {"single", "variable_tracking_2", "variable_tracking_3"}
    spec, seed = STAGE0.needle.spec(), NeedleSuite().seed
    for name, hops in (("single", 2), ("variable_tracking_3", 3)):
        variant = name.rsplit("_", 1)[0] if name.startswith("variable") else name
        probes = [make_probe(variant, spec, 4, seed, i, hops) for i in range(3)]
        pairs = [(set(e), set(top_chunks(p.memory.tolist(), q, 1))) for p in probes
                 for q, e in zip(p.questions, p.evidence, strict=True)]
        assert summary["recall"][name]["4x"] == round(sum(e <= kept for e, kept in pairs) / len(pairs), 4)
    # a chain of three facts rarely fits the top chunk whole, a single fact mostly does
    assert summary["recall"]["variable_tracking_3"]["1x"] < summary["recall"]["single"]["1x"]


def test_a_run_covers_every_task_and_size_by_default():
    done = subprocess.run([sys.executable, "benchmarks/rag_recall.py", "--memories", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    recall = json.loads(done.stdout.strip().splitlines()[-1])["recall"]
    assert set(recall) == {"single", "multi_key", "multi_value", "multi_query", "variable_tracking_2",
                           "variable_tracking_3", "alias", "alias_multi_key", "two_hop", "three_hop"}
    assert all(set(sizes) == {"1x", "4x", "16x", "64x"} and all(0 <= r <= 1 for r in sizes.values())
               for sizes in recall.values())
    # an alias question shares no token with its memory: BM25 scores every chunk 0 and keeps the first two (chance)
    assert recall["alias"]["64x"] < 0.1 and recall["single"]["64x"] == 1.0


def test_a_retriever_export_ranks_instead_of_bm25(checkpoint_root, tmp_path):
    """--retriever EXPORT: the same count, ranked by the export's cosine scores (a random tiny retriever here); a
    directory that is not an export is refused with exit 2 and what to pass."""
    from models import build_pair
    from models.retriever import DenseRetriever

    retriever = DenseRetriever(build_pair("tiny", checkpoint_root=checkpoint_root).memory_encoder.encoder)
    retriever.save_pretrained(tmp_path / "export")
    done = subprocess.run([sys.executable, "benchmarks/rag_recall.py", "--k", "1", "--multipliers", "4",
                           "--variants", "alias", "--memories", "2", "--retriever", str(tmp_path / "export")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["retriever"] == "dense"
    probes = [make_probe("alias", STAGE0.needle.spec(), 4, NeedleSuite().seed, i) for i in range(2)]
    pairs = [(set(e), {int(retriever.scores(p.memory.tolist(), [q])[0].argmax())}) for p in probes
             for q, e in zip(p.questions, p.evidence, strict=True)]
    assert summary["recall"]["alias"]["4x"] == round(sum(e <= kept for e, kept in pairs) / len(pairs), 4)
    refused = subprocess.run([sys.executable, "benchmarks/rag_recall.py", "--retriever", str(tmp_path)], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "retriever.json" in refused.stderr


def test_reread_also_keeps_the_top_k_of_each_key_a_chain_names():
    """--reread: a chain question keeps BM25's top k for its question and for each key its answer names; counted here
    by hand. A key a chain passes is written twice (`ka = kb ;`, `kb = ... ;`), in two chunks: at k 2 retrieving again
    at each key finds every link."""
    done = subprocess.run([sys.executable, "benchmarks/rag_recall.py", "--reread", "--k", "2", "--multipliers", "16",
                           "--variants", "single", "two_hop", "three_hop", "--memories", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["reread"] is True
    spec, seed = STAGE0.needle.spec(), NeedleSuite().seed
    for variant in ("two_hop", "three_hop"):
        held = asked = 0
        for probe in (make_probe(variant, spec, 16, seed, i) for i in range(2)):
            chunks = probe.memory.tolist()
            for question, path, evidence in zip(probe.questions, probe.paths, probe.evidence, strict=True):
                kept = set(top_chunks(chunks, question, 2))
                kept |= {c for key in path for c in top_chunks(chunks, [1, key], 2)}  # one-token keys
                held += set(evidence) <= kept
                asked += 1
        assert summary["recall"][variant]["16x"] == round(held / asked, 4) == 1.0
    assert summary["recall"]["single"]["16x"] == 1.0  # no path: the question's top k alone
