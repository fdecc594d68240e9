"""Tree-sitter parsing (the official per-language grammar wheels) and the facts stage-0 code Q&A asks about.

A fact is a question with its evidence: `spans`, the line ranges (1-based, inclusive) that hold the question's
subject and its answer, e.g. for "which class defines the method m" the `class Owner` line and the `def m` line,
however far apart; `start_line`/`end_line` are the first and the last of them. The memory of its row holds every
chunk that covers a span (pipelines.corpora.tasks), so the answer can be read from those chunks: a file's
path from their headers (`### <path> [chunk k]`), anything else from their text (`tests/pipelines/corpora/test_tasks.py`
checks both, per kind). Python gets every kind (defines, params, method_of, returns, raises, calls, constant); the
other languages get `defines` and `params` from their grammars' `name` / `parameters` fields. Whether a name is
unique in its repository (so the answer is deterministic) is decided later, per repository.
"""

from __future__ import annotations

import functools
import importlib

import tree_sitter

# language -> (module, function returning the grammar)
GRAMMARS = {
    "python": ("tree_sitter_python", "language"), "javascript": ("tree_sitter_javascript", "language"),
    "typescript": ("tree_sitter_typescript", "language_typescript"),
    "tsx": ("tree_sitter_typescript", "language_tsx"), "go": ("tree_sitter_go", "language"),
    "rust": ("tree_sitter_rust", "language"), "java": ("tree_sitter_java", "language"),
    "c": ("tree_sitter_c", "language"), "cpp": ("tree_sitter_cpp", "language"),
}
# Definition node types whose name/parameters the generic extractor reads, per language.
FUNCTIONS = {
    "javascript": {"function_declaration", "method_definition", "generator_function_declaration"},
    "typescript": {"function_declaration", "method_definition", "function_signature"},
    "go": {"function_declaration", "method_declaration"},
    "rust": {"function_item"},
    "java": {"method_declaration", "constructor_declaration"},
    "c": {"function_definition"}, "cpp": {"function_definition"},
}
FUNCTIONS["tsx"] = FUNCTIONS["typescript"]
TYPES = {
    "javascript": {"class_declaration"}, "typescript": {"class_declaration", "interface_declaration"},
    "go": {"type_spec"}, "rust": {"struct_item", "enum_item", "trait_item"},
    "java": {"class_declaration", "interface_declaration", "enum_declaration"},
    "c": {"struct_specifier"}, "cpp": {"class_specifier", "struct_specifier"},
}
TYPES["tsx"] = TYPES["typescript"]


@functools.lru_cache(maxsize=None)
def parser(language: str) -> tree_sitter.Parser:
    module, fn = GRAMMARS[language]
    try:
        grammar = getattr(importlib.import_module(module), fn)()
    except ImportError as e:
        raise RuntimeError(f"no tree-sitter grammar for {language}: pip install {module.replace('_', '-')}") from e
    return tree_sitter.Parser(tree_sitter.Language(grammar))


def parse(language: str, source: bytes) -> tree_sitter.Tree | None:
    return parser(language).parse(source) if language in GRAMMARS else None


def boundaries(tree: tree_sitter.Tree | None, big: int = 40) -> dict[int, int]:
    """0-based line -> cut priority: 2 where a top-level node starts, 1 where a statement or member inside a
    large node (> `big` lines) starts, at any depth."""
    if tree is None:
        return {}
    out: dict[int, int] = {}
    stack = [(n, 2) for n in tree.root_node.named_children]
    while stack:
        node, priority = stack.pop()
        out[node.start_point[0]] = max(out.get(node.start_point[0], 0), priority)
        if node.end_point[0] - node.start_point[0] > big:
            body = node.child_by_field_name("body") or node
            stack.extend((child, 1) for child in body.named_children if child.start_point[0] > node.start_point[0])
    out.pop(0, None)
    return out


def text(node: tree_sitter.Node) -> str:
    return node.text.decode("utf-8", "replace")


def lines(node: tree_sitter.Node) -> tuple[int, int]:
    """The node's 1-based, inclusive line span."""
    return node.start_point[0] + 1, node.end_point[0] + 1


def first_line(node: tree_sitter.Node) -> tuple[int, int]:
    """The line a node starts on (where a definition names itself)."""
    return node.start_point[0] + 1, node.start_point[0] + 1


def merge_spans(spans) -> list[list[int]]:
    """Sorted, overlapping or touching spans joined."""
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def fact(kind: str, name: str, question: str, answer: str, path: str, *spans: tuple[int, int]) -> dict:
    """spans: where the question's subject and its answer stand (the evidence)."""
    spans = merge_spans(spans)
    return {"kind": kind, "name": name, "question": question, "answer": answer, "path": path,
            "start_line": spans[0][0], "end_line": spans[-1][1], "spans": spans}


def facts(language: str, tree: tree_sitter.Tree | None, path: str) -> list[dict]:
    if tree is None:
        return []
    if language == "python":
        return python_facts(tree.root_node, path)
    return generic_facts(language, tree.root_node, path)


def python_facts(root: tree_sitter.Node, path: str) -> list[dict]:
    out: list[dict] = []
    for node in root.named_children:
        target = node.child_by_field_name("definition") if node.type == "decorated_definition" else node
        if target is None:
            continue
        if target.type == "function_definition":
            out += python_function(target, path, owner=None)
        elif target.type == "class_definition":
            name_node = target.child_by_field_name("name")
            name, class_line = text(name_node), first_line(name_node)
            out.append(fact("defines", name, f"Which file defines the class `{name}`?", path, path, class_line))
            for member in target.child_by_field_name("body").named_children:
                member = member.child_by_field_name("definition") if member.type == "decorated_definition" else member
                if member is not None and member.type == "function_definition":
                    out += python_function(member, path, owner=name, owner_line=class_line)
        elif target.type == "expression_statement" and target.named_child_count == 1:
            assign = target.named_children[0]
            left, right = assign.child_by_field_name("left"), assign.child_by_field_name("right")
            if assign.type == "assignment" and left is not None and right is not None and left.type == "identifier":
                name = text(left)
                if name.isupper() and len(name) > 2 and "\n" not in text(assign) and len(text(right)) <= 80:
                    # no line number in the answer: a chunk's text does not say which lines it holds
                    out.append(fact("constant", name, f"Where is the constant `{name}` set, and to what value?",
                                    f"{path}: {text(assign)}", path, lines(assign)))
    return out


def python_function(node: tree_sitter.Node, path: str, owner: str | None,
                    owner_line: tuple[int, int] | None = None) -> list[dict]:
    """A function's facts; a method's (owner: its class, owner_line: the class's name line) also hold the class
    line, which names it (`Owner.m`) or answers (method_of)."""
    name = text(node.child_by_field_name("name"))
    qual = f"{owner}.{name}" if owner else name
    what = "method" if owner else "function"
    subject = [first_line(node)] + ([owner_line] if owner else [])  # the `def` line, and the `class` line
    params = node.child_by_field_name("parameters")
    out = [fact("params", qual, f"What parameters does the {what} `{qual}` take?", text(params), path,
                *subject, lines(params))]
    if owner is None:
        out.append(fact("defines", name, f"Which file defines the function `{name}`?", path, path, *subject))
    elif not name.startswith("__"):
        out.append(fact("method_of", name, f"Which class defines the method `{name}`?", owner, path, *subject))
    returns, raises, calls = [], [], {}
    body = node.child_by_field_name("body")
    stack = list(body.named_children) if body else []
    while stack:  # walk the body, not into nested functions or classes (their returns are theirs)
        n = stack.pop()
        if n.type in ("function_definition", "class_definition", "lambda"):
            continue
        if n.type == "return_statement" and n.named_child_count:
            returns.append(n)
        elif n.type == "raise_statement" and n.named_child_count:
            exc = n.named_children[0]
            exc = exc.child_by_field_name("function") if exc.type == "call" else exc
            if exc is not None and exc.type in ("identifier", "attribute"):
                raises.append((text(exc), lines(n)))
        elif n.type == "call":
            fn = n.child_by_field_name("function")
            if fn is not None and fn.type == "identifier":
                calls.setdefault(text(fn), []).append(first_line(fn))
        stack.extend(n.named_children)
    if len(returns) == 1 and "\n" not in text(returns[0]):
        value = text(returns[0].named_children[0])
        out.append(fact("returns", qual, f"What does the {what} `{qual}` return?", value, path,
                        *subject, lines(returns[0])))
    if raises:
        names = ", ".join(sorted({exc for exc, _ in raises}))
        out.append(fact("raises", qual, f"Which exceptions does the {what} `{qual}` raise?", names, path,
                        *subject, *(span for _, span in raises)))
    for callee in sorted(calls):  # collected per callee into "which functions call g" per file
        out.append({**fact("call_edge", callee, "", "", path, *subject, *calls[callee]), "caller": qual})
    return out


def generic_facts(language: str, root: tree_sitter.Node, path: str) -> list[dict]:
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        if node.type in FUNCTIONS.get(language, ()):
            name_node, params = function_name_params(node)
            if name_node is not None:
                name = text(name_node)
                out.append(fact("defines", name, f"Which file defines the function `{name}`?", path, path,
                                first_line(name_node)))
                if params is not None:
                    out.append(fact("params", name, f"What parameters does the function `{name}` take?",
                                    text(params), path, first_line(name_node), lines(params)))
        elif node.type in TYPES.get(language, ()) and node.child_by_field_name("name") is not None:
            if node.child_by_field_name("body") is not None or node.type == "type_spec":
                name_node = node.child_by_field_name("name")
                out.append(fact("defines", text(name_node), f"Which file defines the type `{text(name_node)}`?",
                                path, path, first_line(name_node)))
        stack.extend(reversed(node.named_children))
    return out


def function_name_params(node: tree_sitter.Node):
    """(name node, parameters node); C/C++ keep both inside the declarator chain."""
    if node.child_by_field_name("name") is not None:
        return node.child_by_field_name("name"), node.child_by_field_name("parameters")
    decl = node.child_by_field_name("declarator")
    while decl is not None and decl.type != "function_declarator":
        decl = decl.child_by_field_name("declarator")
    if decl is None:
        return None, None
    name = decl.child_by_field_name("declarator")
    if name is None or name.type not in ("identifier", "field_identifier"):
        return None, None
    return name, decl.child_by_field_name("parameters")
