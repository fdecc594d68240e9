"""Tree-sitter parsing (the official per-language grammar wheels) and the facts stage-0 code Q&A asks about.

A fact is a question whose answer is a substring of the file between `start_line` and `end_line` (1-based,
inclusive): `tests/corpora/test_code_qa.py` re-reads every answer from its evidence span. Python gets every kind
(defines, params, method_of, returns, raises, calls, constant); the other languages get `defines` and `params`
from their grammars' `name` / `parameters` fields. Whether a name is unique in its repository (so the answer is
deterministic) is decided later, per repository (pipelines.data.corpora.tasks).
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


def fact(kind: str, name: str, question: str, answer: str, node_or_lines, path: str) -> dict:
    if isinstance(node_or_lines, tuple):
        start, end = node_or_lines
    else:
        start, end = node_or_lines.start_point[0] + 1, node_or_lines.end_point[0] + 1
    return {"kind": kind, "name": name, "question": question, "answer": answer, "path": path,
            "start_line": start, "end_line": end}


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
            name = text(target.child_by_field_name("name"))
            out.append(fact("defines", name, f"Which file defines the class `{name}`?", path, target, path))
            for member in target.child_by_field_name("body").named_children:
                member = member.child_by_field_name("definition") if member.type == "decorated_definition" else member
                if member is not None and member.type == "function_definition":
                    out += python_function(member, path, owner=name)
        elif target.type == "expression_statement" and target.named_child_count == 1:
            assign = target.named_children[0]
            left, right = assign.child_by_field_name("left"), assign.child_by_field_name("right")
            if assign.type == "assignment" and left is not None and right is not None and left.type == "identifier":
                name = text(left)
                if name.isupper() and len(name) > 2 and "\n" not in text(assign) and len(text(right)) <= 80:
                    out.append(fact("constant", name, f"Where is the constant `{name}` set, and to what value?",
                                    f"{path}, line {assign.start_point[0] + 1}: {text(assign)}",
                                    assign, path))
    return out


def python_function(node: tree_sitter.Node, path: str, owner: str | None) -> list[dict]:
    name = text(node.child_by_field_name("name"))
    qual = f"{owner}.{name}" if owner else name
    what = "method" if owner else "function"
    params = node.child_by_field_name("parameters")
    out = [fact("params", qual, f"What parameters does the {what} `{qual}` take?", text(params), params, path)]
    if owner is None:
        out.append(fact("defines", name, f"Which file defines the function `{name}`?", path, node, path))
    elif not name.startswith("__"):
        out.append(fact("method_of", name, f"Which class defines the method `{name}`?", owner, node, path))
    returns, raises, calls = [], [], set()
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
                raises.append(text(exc))
        elif n.type == "call":
            fn = n.child_by_field_name("function")
            if fn is not None and fn.type == "identifier":
                calls.add(text(fn))
        stack.extend(n.named_children)
    if len(returns) == 1 and "\n" not in text(returns[0]):
        value = text(returns[0].named_children[0])
        out.append(fact("returns", qual, f"What does the {what} `{qual}` return?", value, returns[0], path))
    if raises:
        names = ", ".join(sorted(set(raises)))
        out.append(fact("raises", qual, f"Which exceptions does the {what} `{qual}` raise?", names, node, path))
    for callee in sorted(calls):  # collected per callee into "which functions call g" per file
        out.append({"kind": "call_edge", "name": callee, "caller": qual, "path": path,
                    "start_line": node.start_point[0] + 1, "end_line": node.end_point[0] + 1})
    return out


def generic_facts(language: str, root: tree_sitter.Node, path: str) -> list[dict]:
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        if node.type in FUNCTIONS.get(language, ()):
            name_node, params = function_name_params(node)
            if name_node is not None:
                name = text(name_node)
                out.append(fact("defines", name, f"Which file defines the function `{name}`?", path, node, path))
                if params is not None:
                    out.append(fact("params", name, f"What parameters does the function `{name}` take?",
                                    text(params), params, path))
        elif node.type in TYPES.get(language, ()) and node.child_by_field_name("name") is not None:
            if node.child_by_field_name("body") is not None or node.type == "type_spec":
                name = text(node.child_by_field_name("name"))
                out.append(fact("defines", name, f"Which file defines the type `{name}`?", path, node, path))
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
