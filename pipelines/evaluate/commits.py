"""The `commits` suite of jobs/evaluate.py: held-out stage-2 commits (the val split of a `jobs/build_corpus.py
--stage 2` corpus), each asked of a system as it trained on it, scored on the new file it writes.

Per row (one commit in one prompt variant):
- exact: the generated new file is the commit's new file (NFC-normalised, as the tokenizer reads text);
- edit similarity: normalised Levenshtein (metrics.edit_similarity) between the generated edit's diff and the
  commit's, both as unified diffs of the parent file computed here the same way (RepoBench/CrossCodeEval compare
  the code; on a whole-file edit the diff is the part that changed, so an unchanged copy of the parent scores low);
- pass@1, pass@5 (Chen et al.'s unbiased estimator, metrics.pass_at_k) over `samples` sampled generations, where the
  repository has tests at the parent commit and they pass with the commit's own file (a commit whose reference fails
  its tests says nothing about the model, and is counted apart): the parent tree is rebuilt from git objects with
  plumbing only (no checkout, no filters, no hooks), and its tests run with the edit in pipelines.repos.sandbox
  (a temporary copy, time and memory limits, no network, a minimal environment): nothing from a mined repository
  runs outside it;
- agentic compliance (planning rows): `<plan>` -> one or more `<read>` -> `<edit>`, in that order and nothing else,
  every read naming a chunk of the row's memory and one of them a chunk of the file edited.

The greedy generation is scored for exact, edit similarity and compliance; the samples only for pass@k. Generation
is Ray Data batch inference, as the needle suite's: rows mapped by an actor pool whose actors load the model once
(GPU actors with --use_gpu). A system sees a row's memory as it trained: gca through the encoder, in_context/rag/none
through the same transform as training (pipelines.data.streams.collate_memory_mode).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from models import AwarenessModel
from pipelines.corpora.commits import BUILD, VARIANTS, CorpusError, commit_split, parent_file
from pipelines.data.batch_inference import items_dataset, map_with_actors
from pipelines.data.memory_modes import MemoryMode, system_mode
from pipelines.data.streams import prompt_inputs
from pipelines.evaluate.common import Source, SuiteResult, Workers
from pipelines.evaluate.metrics import edit_similarity, pass_at_k, rate_interval
from pipelines.format.shards import head_rows
from pipelines.format.tokenizer import EOS, PAD, SPECIAL_IDS, cached_tokenizer
from pipelines.repos.agentic import READ_TAG, agentic_compliance, chunk_names, decode, edited_file, same_file
from pipelines.repos.parent_trees import ParentTree, ParentTrees

COLUMNS = ["task", "variant", "target", "answer", "memory", "evidence", "origin", "input_ids", "labels",
           "memory_input_ids"]


@dataclass
class CommitsSuite:
    corpus: str | None = None  # a stage-2 corpus (jobs/build_corpus.py --stage 2 --out DIR): DIR, or a split directory
    split: str = "val"  # the held-out split read when corpus is the corpus directory
    variants: list[str] | None = None  # prompt variants scored (raw, hinted, imperative, planning); None: all
    max_rows: int = 64  # rows read from the split, in its fixed order
    samples: int = 5  # sampled generations per row whose repository has tests: pass@1 and pass@5 (k <= samples)
    temperature: float = 0.8  # sampling temperature of the pass@k samples (the scored edit is greedy)
    top_p: float = 0.95  # nucleus sampling for the pass@k samples
    max_new_tokens: int = 2048  # generated tokens per answer (a whole new file)
    seed: int = 20261124  # sampling seed (per row: seed + row index)
    test_command: list[str] | None = None  # run in the sandbox in the repository's copy; None: pytest -q -x
    timeout_s: float = 120.0  # per test run, wall clock
    memory_mb: int = 2048  # per test run, address space

    def problems(self) -> list[str]:
        p = []
        if not self.corpus:
            p.append(f"commits.corpus: name a stage-2 corpus: build one with `{BUILD}` and pass --commits.corpus DIR")
        elif not Path(self.corpus).expanduser().is_dir():
            p.append(f"commits.corpus {self.corpus}: no such directory; build it with `{BUILD}`")
        bad = set(self.variants or []) - set(VARIANTS)
        if bad:
            p.append(f"commits.variants {sorted(bad)} unknown; choose from {VARIANTS}")
        if self.max_rows < 1 or self.samples < 1 or self.max_new_tokens < 1:
            p.append("commits.max_rows, commits.samples and commits.max_new_tokens must be positive")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            p.append("commits.temperature must be > 0 and commits.top_p in (0, 1] (pass@k samples)")
        if self.timeout_s <= 0 or self.memory_mb <= 0:
            p.append("commits.timeout_s and commits.memory_mb must be positive")
        return p


# ---------------------------------------------------------------------------------------------- the corpus
def load_rows(settings: CommitsSuite) -> tuple[list[dict[str, Any]], str | None]:
    """The split's first max_rows commit rows of the chosen variants, and the tokenizer checkpoint the corpus was
    built with (None: the offline Qwen3 tokenizer)."""
    path, split, manifest = commit_split(settings.corpus, settings.split)
    rows = head_rows(split, columns=COLUMNS, variants=settings.variants, limit=settings.max_rows)
    rows = [r for r in rows if r["task"] == "commit"]
    if not rows:
        raise CorpusError(f"commits.corpus {path}: no commit rows{' of commits.variants' if settings.variants else ''}")
    if any(r["origin"] is None for r in rows):
        raise CorpusError(f"commits.corpus {path} records no commit origins (built before they were): rebuild it "
                          f"with `{BUILD}`")
    name = manifest.get("tokenizer", {}).get("name", "")
    return rows, name.split(":", 1)[1] if name.startswith("tokenizers:") else None


# ---------------------------------------------------------------------------------------------- generation
@torch.no_grad()
def generate_answers(model, mode: MemoryMode, row: dict[str, Any], tokenizer, settings: CommitsSuite, *,
                     samples: int, seed: int) -> tuple[str, list[str]]:
    """The greedy answer and `samples` sampled ones, as text."""
    inputs = {k: v.to(model.device) for k, v in prompt_inputs(row, mode).items()}
    start = inputs["input_ids"].shape[1]
    common = {"max_new_tokens": settings.max_new_tokens, "eos_token_id": SPECIAL_IDS[EOS],
              "pad_token_id": SPECIAL_IDS[PAD]}
    greedy = model.generate(**inputs, do_sample=False, **common)[0, start:].tolist()
    sampled = []
    if samples:
        torch.manual_seed(seed)
        out = model.generate(**inputs, do_sample=True, temperature=settings.temperature, top_p=settings.top_p,
                             num_return_sequences=samples, **common)
        sampled = [decode(tokenizer, ids) for ids in out[:, start:].tolist()]
    return decode(tokenizer, greedy), sampled


class CommitGenerator:
    """A Ray Data actor: loads one system's export once, answers batches of commit rows."""

    def __init__(self, export: str, system: dict[str, Any], settings: dict[str, Any], tokenizer: str | None,
                 use_gpu: bool):
        self.model = AwarenessModel.from_pretrained(export).to("cuda" if use_gpu else "cpu").eval()
        self.mode, self.settings = system_mode(system), CommitsSuite(**settings)
        self.tokenizer = cached_tokenizer(tokenizer)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        out: dict[str, list] = {"index": [], "greedy": [], "samples": []}
        for index, samples, payload in zip(batch["index"], batch["samples"], batch["row"], strict=True):
            row, seed = json.loads(payload), self.settings.seed + int(index)
            greedy, sampled = generate_answers(self.model, self.mode, row, self.tokenizer, self.settings,
                                               samples=int(samples), seed=seed)
            out["index"].append(int(index))
            out["greedy"].append(greedy)
            out["samples"].append(json.dumps(sampled))
        return out


# ---------------------------------------------------------------------------------------------- scoring
def file_diff(before: str, after: str) -> str:
    """The unified diff (3 lines of context, no file headers) from `before` to `after`."""
    lines = difflib.unified_diff(before.splitlines(), after.splitlines(), n=3, lineterm="")
    return "\n".join(list(lines)[2:])


def diff_similarity(parent: str, generated: str, reference: str) -> float:
    """Edit similarity of the generated edit's diff to the reference edit's, both against the parent file."""
    return edit_similarity(file_diff(parent, generated), file_diff(parent, reference))


def real_reads(row: dict[str, Any]) -> list[str]:
    return chunk_names(row["memory"]) + [r.strip() for r in READ_TAG.findall(row["target"])]


# ---------------------------------------------------------------------------------------------- the suite
@dataclass
class Commit:
    """What a commit shares between its variant rows and the systems: its parent tree, the edited file as it was
    there, and whether the tests pass with the commit's own file."""

    tree: ParentTree
    parent: str  # the edited file at the parent
    reference_passes: bool = False


class CommitsEvaluation:
    """The suite for every system: rows read once, parent trees rebuilt and reference tests run once per commit."""

    name: ClassVar[str] = "commits"

    def __init__(self, settings: CommitsSuite, workers: Workers):
        self.settings, self.workers = settings, workers
        self.rows, self.tokenizer = load_rows(settings)
        self.trees = ParentTrees(timeout_s=settings.timeout_s, memory_mb=settings.memory_mb,
                                 test_command=settings.test_command)
        self.close = self.trees.close  # the parent trees on disk, removed also on an error
        self.commits: dict[tuple[str, str, str], Commit] = {}

    def commit(self, row: dict[str, Any]) -> Commit:
        origin, path = row["origin"], row["evidence"]["path"]
        key = (origin["repository"], origin["commit"], path)
        if key not in self.commits:
            tree = self.trees.tree(origin)
            commit = Commit(tree, parent_file(origin, path) if tree.root is not None else "")
            commit.reference_passes = tree.has_tests and self.trees.passes(tree, path, row["answer"])
            self.commits[key] = commit
        return self.commits[key]

    def score(self, row: dict[str, Any], greedy: str, samples: list[str]) -> dict[str, Any]:
        """One row's record: exact, edit similarity, compliance (planning rows), tests passed of the samples."""
        commit, path = self.commit(row), row["evidence"]["path"]
        generated = edited_file(greedy)
        record = {"variant": row["variant"], "commit": row["origin"]["commit"], "path": path,
                  "exact": same_file(generated, row["answer"]), "repository": commit.tree.root is not None,
                  "has_tests": commit.tree.has_tests, "reference_passes": commit.reference_passes}
        if commit.tree.root is not None:
            record["edit_similarity"] = diff_similarity(commit.parent, generated, row["answer"])
        if row["variant"] == "planning":
            record["agentic"] = agentic_compliance(greedy, real_reads(row), path)
        if commit.reference_passes:
            record["samples"] = len(samples)
            record["passed"] = sum(self.trees.passes(commit.tree, path, edited_file(s)) for s in samples)
        return record

    def run(self, source: Source) -> SuiteResult:
        """The system's records (results.json's `commits` section) and their metrics."""
        records = self.records(source)
        metrics, counts = commits_metrics(records)
        return SuiteResult(metrics, counts, {"commits": records}, f"{source.name}: {summary_line(metrics, counts)}")

    def records(self, source: Source) -> list[dict[str, Any]]:
        """Generate for every row on Ray Data actors, score on the driver (tests in the sandbox)."""
        items = [{"index": i, "samples": self.settings.samples if self.commit(row).reference_passes else 0,
                  "row": json.dumps({k: row[k] for k in ("input_ids", "labels", "memory_input_ids")})}
                 for i, row in enumerate(self.rows)]
        generated = map_with_actors(
            items_dataset(items), CommitGenerator, actors=self.workers.actors, batch_size=1,
            cpus_per_actor=self.workers.cpus_per_actor, use_gpu=self.workers.use_gpu,
            constructor_kwargs={"export": source.export, "system": source.system, "settings": asdict(self.settings),
                                "tokenizer": self.tokenizer, "use_gpu": self.workers.use_gpu}).take_all()
        by_index = {int(g["index"]): g for g in generated}
        return [self.score(row, by_index[i]["greedy"], json.loads(by_index[i]["samples"]))
                for i, row in enumerate(self.rows)]


def commits_metrics(records: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, int]]:
    """Rates with their Wilson 95% intervals (`NAME/ci95`; pass@k's over rows, its mean rounded to a count), the
    mean edit similarity, per variant too; counts of rows, rows with tests, and rows whose reference fails them."""
    metrics: dict[str, Any] = {}

    def rate(name: str, values: list[float]) -> None:
        if values:
            metrics[name] = sum(values) / len(values)
            metrics[f"{name}/ci95"] = list(rate_interval(round(sum(values)), len(values)))

    rate("commits/exact", [float(r["exact"]) for r in records])
    similar = [r["edit_similarity"] for r in records if "edit_similarity" in r]
    if similar:
        metrics["commits/edit_similarity"] = sum(similar) / len(similar)
    for variant in sorted({r["variant"] for r in records}):
        mine = [r for r in records if r["variant"] == variant]
        rate(f"commits/{variant}/exact", [float(r["exact"]) for r in mine])
        similar = [r["edit_similarity"] for r in mine if "edit_similarity" in r]
        if similar:
            metrics[f"commits/{variant}/edit_similarity"] = sum(similar) / len(similar)
    tested = [r for r in records if "passed" in r]
    for k in (1, 5):
        if tested and all(r["samples"] >= k for r in tested):
            rate(f"commits/pass@{k}", [pass_at_k(r["samples"], r["passed"], k) for r in tested])
    rate("commits/agentic_compliance", [float(r["agentic"]) for r in records if "agentic" in r])
    counts = {"commits/rows": len(records), "commits/rows_with_tests": sum(r["has_tests"] for r in records),
              "commits/rows_tested": len(tested),
              "commits/rows_reference_fails": sum(r["has_tests"] and not r["reference_passes"] for r in records),
              "commits/rows_without_repository": sum(not r["repository"] for r in records),  # or its objects
              "commits/planning_rows": sum("agentic" in r for r in records)}
    return metrics, counts


def summary_line(metrics: dict[str, Any], counts: dict[str, int]) -> str:
    shown = [(name, metrics.get(f"commits/{name}")) for name in
             ("exact", "edit_similarity", "pass@1", "pass@5", "agentic_compliance")]
    return ("commits " + "  ".join(f"{name} {value:.2f}" for name, value in shown if value is not None)
            + f"  ({counts['commits/rows']} rows, {counts['commits/rows_tested']} tested)")
