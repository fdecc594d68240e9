"""Tree-sitter facts and cut points (pipelines/corpora/syntax.py) on a hand-read Python file and C and Go snippets:
each fact's kind, answer and evidence spans (the subject's line and the answer's), and where chunks may be cut."""

from __future__ import annotations

from pipelines.corpora import syntax

PY = '''"""Doc."""

import os

LIMIT = 10
x = 1


def helper(a, b=2):
    return a + b


class Box:
    def __init__(self, n):
        self.n = n

    def grow(self, k):
        if k < 0:
            raise ValueError(k)
        helper(k, 1)
        return self.n


@decorator
def wrapped():
    helper(1)
    return None
'''


def facts_of(language: str, source: str, path: str) -> dict[tuple[str, str], dict]:
    return {(f["kind"], f["name"]): f for f in syntax.facts(language, syntax.parse(language, source.encode()), path)
            if f["kind"] != "call_edge"}


def test_python_facts_with_their_evidence_lines():
    facts = facts_of("python", PY, "s.py")
    assert set(facts) == {
        ("constant", "LIMIT"), ("params", "helper"), ("defines", "helper"), ("returns", "helper"), ("defines", "Box"),
        ("params", "Box.__init__"), ("params", "Box.grow"), ("method_of", "grow"), ("returns", "Box.grow"),
        ("raises", "Box.grow"), ("params", "wrapped"), ("defines", "wrapped"), ("returns", "wrapped")}
    # `x = 1` is no constant (lower case, too short); __init__ is no method_of question; `import os` is no fact
    answers = {key: (f["answer"], f["spans"]) for key, f in facts.items()}
    assert answers[("constant", "LIMIT")] == ("s.py: LIMIT = 10", [[5, 5]])
    assert answers[("params", "helper")] == ("(a, b=2)", [[9, 9]])
    assert answers[("returns", "helper")] == ("a + b", [[9, 10]])
    assert answers[("defines", "Box")] == ("s.py", [[13, 13]])
    # a method's facts hold the `class Box:` line (13), which names the class, and its own `def` line (17)
    assert answers[("method_of", "grow")] == ("Box", [[13, 13], [17, 17]])
    assert answers[("raises", "Box.grow")] == ("ValueError", [[13, 13], [17, 17], [19, 19]])
    assert answers[("returns", "Box.grow")] == ("self.n", [[13, 13], [17, 17], [21, 21]])
    assert answers[("defines", "wrapped")] == ("s.py", [[25, 25]])  # the decorated function's own def line
    assert facts[("params", "Box.grow")]["question"] == "What parameters does the method `Box.grow` take?"
    assert (facts[("raises", "Box.grow")]["start_line"], facts[("raises", "Box.grow")]["end_line"]) == (13, 19)


def test_call_edges_name_the_caller_and_the_call_line():
    edges = {(f["name"], f["caller"]): f["spans"] for f in syntax.facts("python", syntax.parse("python", PY.encode()),
                                                                          "s.py") if f["kind"] == "call_edge"}
    assert edges[("helper", "Box.grow")] == [[13, 13], [17, 17], [20, 20]]
    assert edges[("helper", "wrapped")] == [[25, 26]]  # the def line and the call on the next: merged
    assert ("helper", "helper") not in edges


def test_c_and_go_definitions_and_parameters():
    c = facts_of("c", "struct buf { int n; };\n\nchar *name_of(struct buf *b, int k) {\n  return 0;\n}\n", "b.c")
    assert {k: f["answer"] for k, f in c.items()} == {
        ("defines", "buf"): "b.c", ("defines", "name_of"): "b.c", ("params", "name_of"): "(struct buf *b, int k)"}
    go = facts_of("go", "package main\n\ntype Server struct{}\n\nfunc (s Server) Serve(addr string) error {\n"
                        "\treturn nil\n}\n", "m.go")
    assert {k: (f["answer"], f["spans"]) for k, f in go.items()} == {
        ("defines", "Server"): ("m.go", [[3, 3]]), ("defines", "Serve"): ("m.go", [[5, 5]]),
        ("params", "Serve"): ("(addr string)", [[5, 5]])}
    assert syntax.parse("cobol", b"x") is None and syntax.facts("cobol", None, "x") == []


def test_boundaries_top_level_nodes_then_members_of_large_ones():
    tree = syntax.parse("python", PY.encode())
    assert syntax.boundaries(tree) == {2: 2, 4: 2, 5: 2, 8: 2, 12: 2, 23: 2}  # 0-based; line 0 is never a cut
    nested = syntax.boundaries(tree, big=3)  # Box (10 lines) and grow (5) are large: their members may be cuts
    assert nested == {2: 2, 4: 2, 5: 2, 8: 2, 12: 2, 23: 2, 13: 1, 16: 1, 17: 1, 19: 1, 20: 1}
    assert syntax.boundaries(None) == {}


def test_merge_spans_joins_overlapping_and_touching():
    assert syntax.merge_spans([(5, 7), (1, 2), (3, 3), (10, 12), (12, 15)]) == [[1, 3], [5, 7], [10, 15]]
    assert syntax.merge_spans([(4, 4)]) == [[4, 4]] and syntax.merge_spans([]) == []
