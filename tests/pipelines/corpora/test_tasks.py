"""Stage-0 rows (pipelines/corpora/tasks.py). Code Q&A on real code nobody here wrote (the installed requests and
click packages): every answer is re-read from its evidence span in the file; the memory holds the evidence; token
columns match the text columns. On a small repository cut into small chunks, every row's answer stands in its
evidence chunks, per kind (issue 14). Chunk boundaries themselves: test_chunking.py."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipelines.corpora import tasks
from pipelines.corpora.sources import walk_files
from pipelines.format.rows import IGNORE
from pipelines.format.tokenizer import EOS, SPECIAL_IDS


def build_rows(root: Path, tokenizer, name: str, **kw) -> list[dict]:
    settings = tasks.Stage0Settings(**kw)
    records = [rec for rel in walk_files(root)
               for rec in tasks.file_records({"root": str(root), "path": rel, "source": name, "unit": name},
                                             tokenizer, settings)]
    return list(tasks.unit_rows(records, tokenizer, settings))


def span(root: Path, ev: dict) -> str:
    lines = (root / ev["path"]).read_text(encoding="utf-8").splitlines(keepends=True)
    return "".join(lines[ev["start_line"] - 1 : ev["end_line"]])


def verify(root: Path, row: dict) -> bool:
    """The answer, re-read from the file at the evidence span."""
    ev, kind, answer = row["evidence"], row["kind"], row["answer"]
    text = span(root, ev)
    name = row["prompt"].split("`")[1]
    if kind == "defines":
        return answer == ev["path"] and (f"def {name}" in text or f"class {name}" in text or name in text)
    if kind == "constant":
        path, assignment = answer.split(": ", 1)
        return path == ev["path"] and assignment in text
    if kind == "method_of":
        owner_lines = (root / ev["path"]).read_text().splitlines()[: ev["start_line"]]
        owner = next(line for line in reversed(owner_lines) if line.startswith("class "))
        return f"def {name}" in text and owner.startswith(f"class {answer}")
    if kind in ("raises", "callers"):
        return all(item.split(".")[-1] in text for item in answer.split(", "))
    return answer in text  # params, returns


@pytest.fixture(scope="module")
def rows(package_roots, tokenizer):
    return {name: build_rows(root, tokenizer, name) for name, root in package_roots.items()}


def test_every_answer_stands_in_its_evidence(rows, package_roots):
    kinds = Counter()
    for name, root in package_roots.items():
        for row in rows[name]:
            if row["task"] != "code_qa":
                continue
            kinds[row["kind"]] += 1
            assert verify(root, row), (row["prompt"], row["answer"], row["evidence"])
    assert set(kinds) >= {"defines", "params", "method_of", "returns", "raises", "callers", "constant"}, kinds
    assert sum(kinds.values()) > 200


def test_memory_keeps_evidence_within_budget(rows, tokenizer):
    for row in rows["click"]:
        assert 1 <= row["memory_chunks"] <= 16
        ev = row["evidence"]
        headers = [m.split("\n", 1)[0] for m in row["memory"]]
        assert len(set(headers)) == len(headers)  # no chunk twice
        if row["task"] == "code_qa":
            assert any(h.startswith(f"### {ev['path']} [chunk ") for h in headers)
        if row["variant"] == "agentic" or row["kind"] == "agentic":
            reads = re.findall(r"<read>(.*?)</read>", row["target"])
            assert reads and set(reads) <= set(headers)  # the <read> actions name chunks that are in the memory


def test_token_columns_match_text(rows, tokenizer):
    for row in rows["requests"][::5]:
        n_prompt = sum(1 for x in row["labels"] if x == IGNORE)
        assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
        assert row["input_ids"][-1] == SPECIAL_IDS[EOS]
        assert tokenizer.decode(row["input_ids"]) == row["prompt"] + row["target"] + EOS
        assert tokenizer.decode(row["input_ids"][:n_prompt]) == row["prompt"]
        assert row["input_ids"][:n_prompt] == tokenizer.encode_text(row["prompt"])  # a served prompt gets these ids
        assert [tokenizer.encode_text(m) for m in row["memory"]] == [list(map(int, m)) for m in row["memory_input_ids"]]
        if "<read>" in row["target"]:
            assert SPECIAL_IDS["<read>"] in row["input_ids"][n_prompt:]


LANGS = {
    "web/app.js": "export function addUser(name, age = 3) {\n  return name;\n}\nclass Store {\n  put(key) {}\n}\n",
    "web/types.ts": "interface Shape { area(): number }\n"
                    "function scale(s: Shape, k: number): number {\n  return k;\n}\n",
    "srv/main.go": "package main\n\ntype Server struct{}\n\n"
                   "func (s Server) Serve(addr string, n int) error {\n\treturn nil\n}\n",
    "core/lib.rs": "pub struct Cache { n: usize }\n\n"
                   "pub fn evict(cache: &mut Cache, n: usize) -> bool {\n    true\n}\n",
    "java/Queue.java": "class Queue {\n  int offer(String item, long ttl) {\n    return 0;\n  }\n}\n",
    "c/buf.c": "struct buf { int n; };\n\nstatic int buf_grow(struct buf *b, size_t need) {\n  return 0;\n}\n",
    "cpp/vec.cpp": "class Vec {\n  int n;\n};\n\nint dot(const Vec& a, const Vec& b) {\n  return 0;\n}\n",
}


def test_other_languages_defines_and_params(tmp_path, tokenizer):
    for rel, src in LANGS.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    rows = [r for r in build_rows(tmp_path, tokenizer, "poly") if r["task"] == "code_qa"]
    got = {(r["kind"], r["prompt"].split("`")[1]): r["answer"] for r in rows}
    assert got[("defines", "addUser")] == "web/app.js" and got[("params", "addUser")] == "(name, age = 3)"
    assert got[("params", "scale")] == "(s: Shape, k: number)" and got[("defines", "Shape")] == "web/types.ts"
    assert got[("params", "Serve")] == "(addr string, n int)" and got[("defines", "Server")] == "srv/main.go"
    assert got[("params", "evict")] == "(cache: &mut Cache, n: usize)" and got[("defines", "Cache")] == "core/lib.rs"
    assert got[("params", "offer")] == "(String item, long ttl)" and got[("defines", "Queue")] == "java/Queue.java"
    assert got[("params", "buf_grow")] == "(struct buf *b, size_t need)" and got[("defines", "buf")] == "c/buf.c"
    assert got[("params", "dot")] == "(const Vec& a, const Vec& b)" and got[("defines", "Vec")] == "cpp/vec.cpp"
    for row in rows:
        assert verify(tmp_path, row) if row["kind"] != "defines" else row["answer"] == row["evidence"]["path"]


# A repository where small chunks (64 tokens) cut a long class between its `class` line and its later methods, a
# section's heading from its first sentence, and a function's `def` line from its `return`; `describe` is defined
# twice (its facts are not unique) and a block-quoted definition cannot be answered from its chunk text.
SHOP = {
    "shop/cart.py": '''"""A shopping cart: items, quantities, a checkout."""

import math

TAX_RATE = 0.21


class CartError(Exception):
    """Raised when a cart cannot be checked out."""


class Cart:
    """A cart of items.

    The class body is long on purpose: with small chunks its `class Cart` line and its later methods fall in
    different chunks, so a question about a method needs both.
    """

    def __init__(self, owner):
        self.owner = owner
        self.items = {}
        self.history = []

    def add_item(self, sku, qty=1):
        self.items[sku] = self.items.get(sku, 0) + qty
        self.history.append(("add", sku, qty))
        return self.items[sku]

    def remove_item(self, sku):
        if sku not in self.items:
            raise KeyError(sku)
        del self.items[sku]
        self.history.append(("remove", sku))

    def count_units(self):
        total = 0
        for qty in self.items.values():
            total += qty
        return total

    def undo_last(self):
        if not self.history:
            return None
        entry = self.history.pop()
        if entry[0] == "add":
            self.items[entry[1]] -= entry[2]
        return entry

    def apply_coupon(self, code, *, stack=False,
                     expires=None):
        if not code:
            raise ValueError("empty coupon")
        if expires is not None and expires < 0:
            raise CartError("expired coupon")
        self.history.append(("coupon", code, stack))
        return len(self.history)

    def checkout_total(self, prices):
        if not self.items:
            raise CartError("empty cart")
        subtotal = sum(prices[sku] * qty for sku, qty in self.items.items())
        return round_cents(subtotal * (1 + TAX_RATE))


def round_cents(amount):
    return math.floor(amount * 100 + 0.5) / 100


def quote_order(cart, prices):
    return round_cents(cart.checkout_total(prices))


def describe(obj):
    return repr(obj)
''',
    "shop/ledger.py": '''"""Ledger entries for orders."""

MAX_ENTRIES = 5000


class Ledger:
    """A ledger of paid orders, kept in memory.

    Entries are appended when an order is paid and never edited; refunds are new entries with a negative amount.
    A ledger can be replayed to rebuild the balance of any customer at any point in time.
    """

    def __init__(self):
        self.entries = []

    def record_payment(self, customer, amount, currency="EUR", note=""):
        if len(self.entries) >= MAX_ENTRIES:
            raise OverflowError(customer)
        self.entries.append((customer, amount, currency, note))
        return truncate_cents(amount)

    def balance_of(self, customer):
        return sum(amount for who, amount, _, _ in self.entries if who == customer)


def truncate_cents(amount):
    return int(amount * 100) / 100


def describe(obj):
    return repr(obj)
''',
    "web/app.js": '''export function renderBadge(label, color = "green") {
  return `<span class="${color}">${label}</span>`;
}

class BadgeStore {
  constructor() {
    this.items = [];
  }

  storeBadge(badge, ttl) {
    this.items.push([badge, ttl]);
  }
}
''',
    "docs/guide.md": '''# Shop guide

This guide explains how the shop's cart and ledger fit together, for people who maintain them and for people who
read the code for the first time. It is long on purpose so that small chunks cut it into several pieces.

## Checkout

A checkout turns the cart into a paid order and writes one ledger entry per payment, with the tax included.

## Coupons

Coupons reduce the total before tax; a coupon that has expired is refused with a cart error and never stacks
with another coupon unless the caller asks for it.

Tidepool is a staging area where orders wait until their payment clears.

> Gizmo is a widget that sits in a block quote and wraps over
> two lines, so its one-line answer drops the quote markers.
''',
}
SHOP_SETTINGS = {"chunk_tokens": 64, "max_facts_per_file": 100, "needles_per_unit": 10}
ROW_KINDS = ("defines", "params", "method_of", "returns", "raises", "callers", "constant", "section", "definition",
             "needle")


@pytest.fixture(scope="module")
def shop_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shop")
    for rel, text in SHOP.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture(scope="module")
def shop_rows(shop_root, tokenizer) -> dict[str, list[dict]]:
    """The shop's rows, all direct and all agentic (so every kind is seen both ways), and the default mix."""
    return {variant: build_rows(shop_root, tokenizer, "shop", agentic_fraction=fraction, **SHOP_SETTINGS)
            for variant, fraction in (("direct", 0.0), ("agentic", 1.0), ("mixed", 0.5))}


def row_kind(row: dict) -> str:
    return "needle" if row["task"] == "needle" else row["kind"]


def evidence_texts(row: dict) -> list[str]:
    """The texts of the row's evidence chunks, from its memory (which must hold each); for an agentic row, its
    reads are exactly those chunks, and the answer follows them."""
    names = row["evidence_chunks"]
    memory = {m.split("\n", 1)[0]: m for m in row["memory"]}
    assert names and len(set(names)) == len(names), row["evidence_chunks"]
    assert all(name in memory for name in names), (names, list(memory))
    if "<read>" in row["target"]:
        assert re.findall(r"<read>(.*?)</read>", row["target"]) == names
        assert row["target"].endswith("</read>" + row["answer"])
    else:
        assert row["target"] == row["answer"]
    return [memory[name] for name in names]


def answer_stands_in_evidence(row: dict) -> bool:
    """The row's answer, read from its evidence chunks' text: a path from their headers, anything else from their
    bodies, where the code or document says it (`class Owner` for method_of, `return x` for returns, ...)."""
    texts = evidence_texts(row)
    heads = [t.split("\n", 1)[0] for t in texts]
    body = "".join(t.split("\n", 1)[1] for t in texts)
    kind, answer, path = row_kind(row), row["answer"], row["evidence"]["path"]
    name = row["prompt"].split("`")[1] if "`" in row["prompt"] else ""
    in_header = all(h.startswith(f"### {path} [chunk ") for h in heads)
    if kind == "defines":
        return answer == path and in_header and re.search(rf"\b{re.escape(name)}\b", body) is not None
    if kind == "params":
        return answer in body and name.split(".")[-1] in body
    if kind == "method_of":
        return f"class {answer}" in body and f"def {name}(" in body
    if kind == "returns":
        return f"return {answer}" in body
    if kind == "raises":
        return all(f"raise {exc}" in body for exc in answer.split(", "))
    if kind == "callers":
        def defined(caller):
            owner, _, fn = caller.rpartition(".")
            return f"def {fn}(" in body and (not owner or f"class {owner}" in body)
        return f"{name}(" in body and all(defined(c) for c in answer.split(", "))
    if kind == "constant":
        where, assignment = answer.split(": ", 1)
        return where == path and in_header and assignment in body
    if kind in ("section", "definition"):
        return " ".join(answer.split()) in " ".join(body.split())
    if kind == "needle":  # the values (multi-value: each) stand in the needles of the evidence chunks
        return all(re.search(rf"(?:is: |= ){v}\.", "".join(texts)) for v in answer.split(", "))
    raise AssertionError(f"no check for {kind}")


@pytest.mark.parametrize("variant", ["direct", "agentic"])
@pytest.mark.parametrize("kind", ROW_KINDS)
def test_answer_stands_in_the_evidence_chunks(shop_rows, kind, variant):
    """Per row kind, direct and agentic: the evidence chunks are in the memory (an agentic row reads exactly
    them) and hold the answer, though small chunks cut the class line from its methods."""
    rows = [r for r in shop_rows[variant] if row_kind(r) == kind]
    assert rows, kind
    for row in rows:
        assert answer_stands_in_evidence(row), (row["prompt"], row["answer"], row["evidence_chunks"])
        assert row["memory_chunks"] <= 16
    if kind in ("method_of", "params", "returns", "raises", "callers", "section"):
        assert any(len(r["evidence_chunks"]) > 1 for r in rows)  # the fixture does cut subject from answer


def test_method_of_evidence_is_the_class_line_and_the_def(shop_rows):
    rows = {r["prompt"].split("`")[1]: r for r in shop_rows["direct"] if r["kind"] == "method_of"}
    assert set(rows) == {"add_item", "remove_item", "count_units", "undo_last", "apply_coupon", "checkout_total",
                         "record_payment", "balance_of"}
    for method, row in rows.items():
        path = row["evidence"]["path"]
        lines = SHOP[path].splitlines()
        class_line, def_line = row["evidence"]["start_line"], row["evidence"]["end_line"]
        assert lines[class_line - 1] == f"class {row['answer']}:" and f"def {method}(" in lines[def_line - 1]
        assert len(row["evidence_chunks"]) <= 2  # those two chunks, not every chunk between them
    cut = rows["checkout_total"]  # the last method of a long class: far from its class line
    assert cut["evidence_chunks"][0] != cut["evidence_chunks"][-1]
    assert f"class {cut['answer']}" not in "".join(
        m for m in cut["memory"] if m.startswith(cut["evidence_chunks"][-1] + "\n"))


def test_every_row_of_a_build_holds_its_answer_in_its_evidence(shop_rows, rows):
    """Every row of the shop's build (direct and agentic mixed) and of the real packages' (512-token chunks)."""
    kinds = Counter()
    for row in shop_rows["mixed"] + rows["requests"] + rows["click"]:
        kinds[row_kind(row)] += 1
        assert answer_stands_in_evidence(row), (row["prompt"], row["answer"], row["evidence_chunks"])
    assert set(kinds) == set(ROW_KINDS), kinds
    assert {r["variant"] for r in shop_rows["mixed"] if r["task"] != "needle"} == {"direct", "agentic"}


def test_facts_without_a_row_are_counted_by_reason(shop_root, tokenizer, tmp_path):
    """The block-quoted definition and the twice-defined `describe` make no row, and are counted, in the
    repository's statistics and in the manifest."""
    from pipelines.corpora import build

    settings = tasks.Stage0Settings(**SHOP_SETTINGS)
    records = [rec for rel in walk_files(shop_root)
               for rec in tasks.file_records({"root": str(shop_root), "path": rel, "source": "shop", "unit": "shop"},
                                             tokenizer, settings)]
    dropped = Counter()
    made = list(tasks.unit_rows(records, tokenizer, settings, dropped))
    assert not any("Gizmo" in r["prompt"] or "describe" in r["prompt"] for r in made)
    assert dropped["answer_not_in_evidence"] == 1  # Gizmo: its "> " markers are not in the one-line answer
    assert dropped["not_unique"] == 6  # describe: defines, params and returns, twice each
    assert set(dropped) <= set(tasks.DROP_REASONS)

    for sub in ("train", "val", "rejects"):
        (tmp_path / sub).mkdir()
    items = [{"root": str(shop_root), "path": rel, "source": "shop", "unit": "shop"} for rel in walk_files(shop_root)]
    stats = json.loads(build.build_unit(items, out=str(tmp_path), make_records=tasks.file_records,
                                        make_rows=build.stage0_rows, settings=settings, checkpoint=None))
    assert stats["dropped_facts"] == {k: n for k, n in dropped.items() if n}
    assert stats["rejected_inputs"] == 0  # facts are not inputs: inputs seen = used + rejected still holds
    manifest = build.make_manifest(build.BuildConfig(), [stats, {**stats, "unit": "again"}], 0.0)
    assert manifest["dropped_facts"]["answer_not_in_evidence"] == 2
    table = pq.read_table(tmp_path / stats["split"])
    assert table.schema.equals(build.ROW_SCHEMA)
    assert all(r["evidence_chunks"] for r in table.to_pylist())
