"""Stage 3, agent-improved training data (jobs/stage3_data.py): a teacher model turns stage-2 commit rows into
agentic trajectories (plan -> reads of the right chunks -> edit), and every candidate is verified before it is kept.

Pipeline (Ray Data, as the corpus build and the teacher logits): the items are the row groups of the corpus split
(names only); an actor pool whose actors each hold the teacher generates `attempts` sampled candidates per row
(transformers `generate`, the row's prompt as the teacher read its training rows, then a `<plan>` token it is asked
to continue from); Ray Data tasks then read the same row group, verify each candidate and write the shards. Only
generated ids and counts pass through the driver.

The teacher is any export whose memory reads a stage-2 row: an `in_context`/`rag` model (the memory in its prompt) or
a GCA pair. Nothing else writes a candidate: the row's answer is never shown to the teacher, and a candidate is kept
only as the teacher wrote it.

Verification, in order; the first failure is the candidate's rejection reason:
    format             not `<plan>…</plan>(<read>…</read>)+<edit>…</edit><|im_end|>` read from its control tokens
                       (empty plan, text outside the tags, cut at max_new_tokens)
    unknown_chunk      a read names no chunk of the row's memory (nor the `### path [new file]` of an added file)
    evidence_not_read  none of the reads is a chunk of the edited file around the change (`evidence_chunks`)
    then the edit:     the commit's own file (NFC) -> accepted, verification `exact`;
    no_change          the parent's file unchanged;
                       else the repository's tests on the parent tree rebuilt from git objects with the edit, in the
                       sandbox (pipelines.repos.sandbox) -> accepted, verification `tests_passed`, or
    tests_failed       they fail;
    edit_mismatch      not the commit's file and nothing to judge it by (no tests at the parent, or they fail with the
                       commit's own file too, or the repository is gone);
    duplicate          the same trajectory as an attempt already accepted for the row.

    OUT/train/*.parquet     accepted rows: the corpus schema (prompt as the stage-2 row's, target = the trajectory
                            re-tokenized as the stage-2 planning rows are, variant `planning`) + provenance
    OUT/rejected/*.parquet  rejected candidates: the same columns, target = what the teacher generated, `verification`
                            its reason and `detail` what failed
    OUT/manifest.json       stage 3: rows in, candidates, accepted (by verification), rejected by reason, the teacher
                            (export, system, weights sha256), the source corpus (its manifest's sha256), settings, and
                            every shard (bytes, rows, row groups, sha256), so stage jobs read OUT/train as any corpus
"""

from __future__ import annotations

import difflib
import hashlib
import json
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from models.awareness import CONFIG_NAME, AwarenessModel
from pipelines.corpora.commits import BUILD, commit_split, parent_file
from pipelines.data.batch_inference import DTYPES, actor_dtype, items_dataset, map_with_actors
from pipelines.data.memory_modes import read_system, system_mode
from pipelines.data.streams import prompt_inputs, prompt_length
from pipelines.format.rows import DICTIONARY_COLUMNS, IGNORE, ROW_SCHEMA
from pipelines.format.shards import MANIFEST, MANIFEST_VERSION, Unit, check_split, shard_record, split_units
from pipelines.format.tokenizer import EOS, PAD, PLAN, SPECIAL_IDS, cached_tokenizer
from pipelines.repos.agentic import (FormatError, Trajectory, chunk_names, decode, parse_trajectory, same_file,
                                     trajectory_parts)
from pipelines.repos.parent_trees import ParentTrees
from pipelines.teachers.logits import teacher_identity

REASONS = ("format", "unknown_chunk", "evidence_not_read", "no_change", "tests_failed", "edit_mismatch", "duplicate")
ACCEPTED = ("exact", "tests_passed")
OUTPUT_SCHEMA = ROW_SCHEMA.append(pa.field("teacher", pa.string())).append(pa.field("attempt", pa.int32())) \
    .append(pa.field("verification", pa.string())).append(pa.field("detail", pa.string())) \
    .append(pa.field("source_id", pa.int64())).append(pa.field("source_variant", pa.string()))


@dataclass
class Stage3Config:
    corpus: str = ""  # a stage-2 corpus: DIR of `python jobs/build_corpus.py --stage 2 ... --out DIR`
    split: str = "train"  # the corpus split whose rows are improved
    max_rows: int | None = None  # the split's first N rows (its fixed order); None: every row
    variants: list[str] | None = None  # stage-2 prompt variants asked (raw, hinted, imperative, planning); None: all
    teacher: str = ""  # an export (in_context/rag model, or a GCA pair): <run>/checkpoint_*/export
    out: str = "outputs/stage3"  # OUT/train, OUT/rejected, OUT/manifest.json (replaced, never mixed)
    attempts: int = 4  # sampled candidates per row
    temperature: float = 1.0  # sampling temperature of the candidates
    top_p: float = 1.0  # nucleus sampling of the candidates (1.0: off)
    max_new_tokens: int = 2048  # per candidate: a plan, reads and a whole new file
    seed: int = 0  # sampling seed (per row: seed + the row's id)
    actors: int = 1  # Ray Data actors, each holding the teacher
    cpus_per_actor: float = 1.0  # CPUs Ray reserves for each teacher actor
    use_gpu: bool = False  # one GPU per actor
    dtype: str | None = None  # float32 | bfloat16 | float16; None: bfloat16 on GPU, float32 on CPU
    test_timeout_s: float = 120.0  # per sandboxed test run of a candidate's edit, wall clock
    test_memory_mb: int = 2048  # per sandboxed test run, address space
    row_group_rows: int = 256  # rows per Parquet row group of the output (the unit training workers shard by)

    def problems(self) -> list[str]:
        p = []
        if not self.corpus:
            p.append(f"corpus: name a stage-2 corpus: build one with `{BUILD}` and pass --corpus DIR")
        elif not Path(self.corpus).expanduser().is_dir():
            p.append(f"corpus {self.corpus}: no such directory; build it with `{BUILD}`")
        if not self.teacher:
            p.append("teacher: name the teacher's export: --teacher EXPORT_DIR (a stage job's export/, e.g. of "
                     "`python jobs/stage2.py --model.memory in_context ...`)")
        elif not (Path(self.teacher) / CONFIG_NAME).is_file():
            p.append(f"teacher {self.teacher} is not an export (no {CONFIG_NAME}): pass a stage job's "
                     f"checkpoint_*/export directory")
        elif system_mode(read_system(self.teacher)).kind == "none":
            p.append(f"teacher {self.teacher} reads no memory (system.json memory none): it cannot read the chunks "
                     f"a trajectory must name; use an in_context, rag or gca export")
        if self.max_rows is not None and self.max_rows < 1:
            p.append("max_rows must be positive or none")
        p += [f"{name} must be positive" for name in ("attempts", "max_new_tokens", "actors", "row_group_rows",
                                                      "test_timeout_s", "test_memory_mb") if getattr(self, name) <= 0]
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            p.append("temperature must be > 0 and top_p in (0, 1]: candidates are sampled")
        if self.dtype is not None and self.dtype not in DTYPES:
            p.append(f"dtype must be one of {sorted(DTYPES)} or none, got {self.dtype!r}")
        return p


# ---------------------------------------------------------------------------------------------- the corpus
def work_items(split_dir: Path, max_rows: int | None) -> list[dict[str, Any]]:
    """The split's row groups in their fixed order (cut after max_rows rows), each with its output shard name."""
    items, taken = [], 0
    for unit in split_units(check_split(split_dir, hashes=False), 1):
        stop = unit.stop if max_rows is None else min(unit.stop, unit.start + max_rows - taken)
        if stop <= unit.start:
            break
        taken += stop - unit.start
        items.append({**asdict(Unit(unit.path, unit.row_group, unit.start, stop, unit.first_id)),
                      "name": f"part-{Path(unit.path).stem}-{unit.row_group:05d}.parquet"})
    return items


def read_unit(item: dict[str, Any], columns: list[str] | None = None) -> list[dict[str, Any]]:
    """A work item's rows, each with its global id in the split."""
    table = pq.ParquetFile(str(item["path"])).read_row_group(int(item["row_group"]), columns=columns)
    rows = table.slice(int(item["start"]), int(item["stop"]) - int(item["start"])).to_pylist()
    for i, row in enumerate(rows):
        row["id"] = int(item["first_id"]) + i
    return rows


# ---------------------------------------------------------------------------------------------- the teacher
@torch.no_grad()
def sample_candidates(model, mode, row: dict[str, Any], *, attempts: int, temperature: float, top_p: float,
                      max_new_tokens: int, seed: int) -> list[list[int]]:
    """`attempts` sampled continuations of the row's prompt (as the teacher reads it) after a `<plan>` token, each
    as ids from `<plan>` to its `<|im_end|>` (or the token limit)."""
    inputs = {k: v.to(model.device) for k, v in prompt_inputs(row, mode).items()}
    plan = torch.tensor([[SPECIAL_IDS[PLAN]]], device=model.device)
    inputs["input_ids"] = torch.cat([inputs["input_ids"], plan], dim=1)  # (1, T + 1)
    start = inputs["input_ids"].shape[1]
    torch.manual_seed(seed)
    out = model.generate(**inputs, do_sample=True, temperature=temperature, top_p=top_p, top_k=0,
                         num_return_sequences=attempts, max_new_tokens=max_new_tokens,
                         eos_token_id=SPECIAL_IDS[EOS], pad_token_id=SPECIAL_IDS[PAD])  # (attempts, start + new)
    eos = SPECIAL_IDS[EOS]
    return [[SPECIAL_IDS[PLAN], *(ids[: ids.index(eos) + 1] if eos in ids else ids)]
            for ids in out[:, start:].tolist()]


class TrajectoryTeacher:
    """A Ray Data actor holding the teacher: each batch item is one row group of the split, read here; returns the
    item with its rows' candidates (generated ids, JSON)."""

    def __init__(self, teacher: str, settings: dict[str, Any], use_gpu: bool, dtype: str):
        self.model = AwarenessModel.from_pretrained(teacher, dtype=DTYPES[dtype],
                                                    device="cuda" if use_gpu else "cpu").eval()
        self.mode, self.settings = system_mode(read_system(teacher)), settings

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        s, out = self.settings, {key: [] for key in (*batch, "candidates")}
        for i in range(len(batch["name"])):
            item = {key: batch[key][i] for key in batch}
            rows = [r for r in read_unit(item, ["variant", "input_ids", "labels", "memory_input_ids"])
                    if not s["variants"] or r["variant"] in s["variants"]]
            candidates = {r["id"]: sample_candidates(self.model, self.mode, r, attempts=s["attempts"],
                                                     temperature=s["temperature"], top_p=s["top_p"],
                                                     max_new_tokens=s["max_new_tokens"], seed=s["seed"] + r["id"])
                          for r in rows}
            for key, value in item.items():
                out[key].append(value)
            out["candidates"].append(json.dumps(candidates))
        return out


# ---------------------------------------------------------------------------------------------- verification
@dataclass(frozen=True)
class Verdict:
    verification: str  # exact | tests_passed (accepted), or a rejection reason (REASONS)
    detail: str = ""
    trajectory: Trajectory | None = None

    @property
    def accepted(self) -> bool:
        return self.verification in ACCEPTED


def new_file_read(row: dict[str, Any]) -> str:
    return f"### {row['evidence']['path']} [new file]"


def verify(ids: list[int], row: dict[str, Any], tokenizer, judge: Callable[[dict[str, Any], str], Verdict]
           ) -> Verdict:
    """One candidate (ids from `<plan>`) against its stage-2 row: format, reads, then the edit (`judge` decides an
    edit that is not the commit's own file: the repository's tests)."""
    try:
        trajectory = parse_trajectory(ids, tokenizer)
    except FormatError as error:
        return Verdict("format", str(error))
    known = set(chunk_names(row["memory"])) | ({new_file_read(row)} if row["kind"] == "add" else set())
    unknown = [r for r in trajectory.reads if r not in known]
    if unknown:
        return Verdict("unknown_chunk", f"read {unknown[0]!r}: no such chunk in the row's memory", trajectory)
    evidence = list(row["evidence_chunks"]) or [new_file_read(row)]
    if not set(trajectory.reads) & set(evidence):
        return Verdict("evidence_not_read", f"read {trajectory.reads}, none of {evidence}", trajectory)
    if same_file(trajectory.edit, row["answer"]):
        return Verdict("exact", "", trajectory)
    verdict = judge(row, trajectory.edit)
    return Verdict(verdict.verification, verdict.detail, trajectory)


class ParentTreeJudge:
    """Judges an edit that is not the commit's own file by the repository's tests on its parent tree
    (pipelines.repos.parent_trees), first with the commit's own file (a reference that fails says nothing about a
    candidate), then with the candidate's; every tree and outcome is computed once."""

    def __init__(self, trees: ParentTrees):
        self.trees = trees

    def __call__(self, row: dict[str, Any], content: str) -> Verdict:
        origin, path = row["origin"], row["evidence"]["path"]
        tree = self.trees.tree(origin)
        if tree.root is None:
            return Verdict("edit_mismatch", f"not the commit's file, and {origin['repository']} is unreadable")
        if same_file(content, parent_file(origin, path)):
            return Verdict("no_change", f"{path} as it was at the parent")
        if not tree.has_tests:
            return Verdict("edit_mismatch", "not the commit's file, and the parent tree has no tests to judge it")
        if not self.trees.passes(tree, path, row["answer"]):
            return Verdict("edit_mismatch", "not the commit's file, and the tests fail with the commit's own file")
        if self.trees.passes(tree, path, content):
            return Verdict("tests_passed")
        return Verdict("tests_failed", f"the repository's tests fail with this {path}")


# ---------------------------------------------------------------------------------------------- output rows
def unified_diff(path: str, before: str, after: str) -> str:
    return "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), f"a/{path}", f"b/{path}"))


def output_row(row: dict[str, Any], ids: list[int], verdict: Verdict, tokenizer, *, teacher: str,
               attempt: int) -> dict[str, Any]:
    """A candidate as a row of OUTPUT_SCHEMA. Accepted: the trajectory re-tokenized as the stage-2 planning rows are
    (tokenizer.encode_parts), after the source row's own prompt ids. Rejected: the generated ids as they came."""
    n = prompt_length(row)
    prompt_ids = list(row["input_ids"][:n])
    if verdict.accepted:
        parts = trajectory_parts(verdict.trajectory)
        target_ids, target = tokenizer.encode_parts(parts) + [SPECIAL_IDS[EOS]], "".join(parts)
        answer = verdict.trajectory.edit
        diff = row["diff"] if verdict.verification == "exact" else unified_diff(
            row["evidence"]["path"], parent_file(row["origin"], row["evidence"]["path"]), answer)
    else:
        target_ids, target = list(ids), decode(tokenizer, ids)
        answer, diff = verdict.trajectory.edit if verdict.trajectory else "", ""
    return {**{k: row[k] for k in ROW_SCHEMA.names}, "variant": "planning", "target": target, "answer": answer,
            "diff": diff, "input_ids": prompt_ids + target_ids, "labels": [IGNORE] * n + target_ids,
            "teacher": teacher, "attempt": attempt, "verification": verdict.verification, "detail": verdict.detail,
            "source_id": row["id"], "source_variant": row["variant"]}


def verify_rows(rows: list[dict[str, Any]], candidates: dict[int, list[list[int]]], tokenizer, judge,
                teacher: str) -> tuple[list[dict], list[dict]]:
    """Every candidate of every row verified: (accepted rows, rejected rows); a row's repeated accepted trajectory
    is a `duplicate`."""
    accepted, rejected = [], []
    for row in rows:
        kept: set[str] = set()
        for attempt, ids in enumerate(candidates.get(row["id"], [])):
            verdict = verify(ids, row, tokenizer, judge)
            if verdict.accepted:
                key = "".join(trajectory_parts(verdict.trajectory))
                if key in kept:
                    verdict = Verdict("duplicate", "the same trajectory as an earlier accepted attempt",
                                      verdict.trajectory)
                kept.add(key)
            out = output_row(row, ids, verdict, tokenizer, teacher=teacher, attempt=attempt)
            (accepted if verdict.accepted else rejected).append(out)
    return accepted, rejected


def write_rows(out: Path, name: str, rows: list[dict], row_group_rows: int) -> dict[str, dict]:
    if not rows:
        return {}
    path = out / name
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=OUTPUT_SCHEMA), path, row_group_size=row_group_rows,
                   use_dictionary=DICTIONARY_COLUMNS + ["teacher", "verification", "source_variant"])
    return {name: shard_record(path)}


class UnitVerifier:
    """The Ray Data task after the teacher: reads a row group's full rows, verifies its candidates (tests in the
    sandbox, parent trees in a temporary directory removed after the item), writes its two shards; returns counts."""

    def __init__(self, out: str, teacher: str, tokenizer: str | None, timeout_s: float, memory_mb: int,
                 row_group_rows: int):
        self.out, self.teacher, self.tokenizer_name = Path(out), teacher, tokenizer
        self.timeout_s, self.memory_mb, self.row_group_rows = timeout_s, memory_mb, row_group_rows

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        tokenizer = cached_tokenizer(self.tokenizer_name)
        stats = []
        for i in range(len(batch["name"])):
            item = {key: batch[key][i] for key in batch}
            candidates = {int(k): v for k, v in json.loads(item["candidates"]).items()}
            rows = [r for r in read_unit(item) if r["id"] in candidates]
            trees = ParentTrees(timeout_s=self.timeout_s, memory_mb=self.memory_mb)
            try:
                accepted, rejected = verify_rows(rows, candidates, tokenizer, ParentTreeJudge(trees), self.teacher)
            finally:
                trees.close()
            shards = {**write_rows(self.out, f"train/{item['name']}", accepted, self.row_group_rows),
                      **write_rows(self.out, f"rejected/{item['name']}", rejected, self.row_group_rows)}
            stats.append(json.dumps(unit_stats(rows, accepted, rejected, shards)))
        return {"stats": stats}


def verify_units(batch: dict[str, Any], **settings: Any) -> dict[str, list]:
    """UnitVerifier as a function: Ray Data schedules functions as tasks (callable classes only on actors)."""
    return UnitVerifier(**settings)(batch)


def unit_stats(rows: list[dict], accepted: list[dict], rejected: list[dict], shards: dict) -> dict[str, Any]:
    return {"rows_in": len(rows), "accepted": dict(Counter(r["verification"] for r in accepted)),
            "rejected": dict(Counter(r["verification"] for r in rejected)),
            "rows_with_accepted": len({r["source_id"] for r in accepted}),
            "source_variants": dict(Counter(r["variant"] for r in rows)),
            "repositories": sorted({r["unit"] for r in rows}), "shards": shards}


# ---------------------------------------------------------------------------------------------- the job
def improve_corpus(config: Stage3Config, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The teacher's candidates for the split's rows (Ray Data actor pool), verified and written (Ray Data tasks);
    writes and returns the manifest. Raises CorpusError for a corpus that is not a stage-2 one."""
    problems = config.problems()
    if problems:
        raise ValueError("\n".join(problems))
    started = time.time()
    split_dir, _, source = commit_split(config.corpus, config.split)
    out = Path(config.out).resolve()
    for sub in ("train", "rejected"):
        shutil.rmtree(out / sub, ignore_errors=True)  # a rerun replaces, never mixes with, older output
    out.mkdir(parents=True, exist_ok=True)
    items = work_items(split_dir, config.max_rows)
    identity = teacher_identity(config.teacher)
    teacher = f"{identity['export']} sha256:{identity['weights_sha256'][:16]}"
    tokenizer = source.get("tokenizer", {}).get("name", "")
    tokenizer = tokenizer.split(":", 1)[1] if tokenizer.startswith("tokenizers:") else None
    dtype = actor_dtype(config.dtype, config.use_gpu)
    settings = {k: getattr(config, k) for k in ("attempts", "temperature", "top_p", "max_new_tokens", "seed",
                                                "variants")}
    progress(f"[stage3] {sum(i['stop'] - i['start'] for i in items)} rows in {len(items)} row groups, "
             f"{config.attempts} attempts each, teacher {identity['export']} ({identity['system'].get('memory')})")
    dataset = items_dataset(items)
    # one row group's sampling can outlast Ray Data's no-progress limit (30 min) on a CPU: the progress lines
    # below show that it moves
    dataset.context.execution_no_progress_timeout_s = -1
    generated = map_with_actors(
        dataset, TrajectoryTeacher, actors=config.actors, batch_size=1, cpus_per_actor=config.cpus_per_actor,
        use_gpu=config.use_gpu,
        constructor_kwargs={"teacher": config.teacher, "settings": settings, "use_gpu": config.use_gpu,
                            "dtype": dtype})
    verified = generated.map_batches(
        verify_units, batch_size=1, num_cpus=1,
        fn_kwargs={"out": str(out), "teacher": teacher, "tokenizer": tokenizer, "timeout_s": config.test_timeout_s,
                   "memory_mb": config.test_memory_mb, "row_group_rows": config.row_group_rows})
    units = []
    for row in verified.iter_rows():
        units.append(json.loads(row["stats"]))
        u = units[-1]
        progress(f"[stage3] {u['rows_in']} rows: {sum(u['accepted'].values())} accepted, "
                 f"{sum(u['rejected'].values())} rejected ({time.time() - started:.0f}s)")
    manifest = stage3_manifest(config, units, source, identity, split_dir, dtype, time.time() - started)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def stage3_manifest(config: Stage3Config, units: list[dict], source: dict[str, Any], identity: dict[str, Any],
                    split_dir: Path, dtype: str, seconds: float) -> dict[str, Any]:
    accepted, rejected, variants = Counter(), Counter(), Counter()
    for u in units:
        accepted.update(u["accepted"])
        rejected.update(u["rejected"])
        variants.update(u["source_variants"])
    rows_in, n_accepted = sum(u["rows_in"] for u in units), sum(accepted.values())
    shards = dict(sorted((name, record) for u in units for name, record in u["shards"].items()))
    return {
        "stage": 3, "rows_in": rows_in, "source_variants": dict(variants),
        "candidates": n_accepted + sum(rejected.values()),
        "accepted": n_accepted, "accepted_by_verification": {k: accepted[k] for k in ACCEPTED},
        "rows_with_an_accepted_candidate": sum(u["rows_with_accepted"] for u in units),
        "rejected": sum(rejected.values()), "rejected_by_reason": {k: rejected[k] for k in REASONS},
        "rows": {"train": n_accepted}, "variants": {"commit/planning": n_accepted},
        "repositories": {"train": sorted({r for u in units for r in u["repositories"]}), "val": []},
        "teacher": identity, "dtype": dtype,
        "source": {"corpus": str(split_dir.parent), "split": split_dir.name, "stage": source.get("stage"),
                   "manifest_sha256": hashlib.sha256((split_dir.parent / MANIFEST).read_bytes()).hexdigest()},
        "sources": source.get("sources", []), "tokenizer": source.get("tokenizer", {}),
        "settings": asdict(config), "seconds": round(seconds, 1),
        "rebuild": f"python jobs/stage3_data.py --corpus {split_dir.parent} --split {split_dir.name} "
                   f"--teacher {config.teacher} --out {config.out}",
        "manifest_version": MANIFEST_VERSION, "shards": shards,
    }
