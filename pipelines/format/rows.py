"""One corpus row: the text columns and the token columns the training job reads, and their Parquet schema.

`input_ids` = prompt tokens + target tokens + `<|im_end|>`; `labels` = -100 over the prompt, the target ids (and
`<|im_end|>`) after it; `memory_input_ids` = one unpadded token list per memory chunk, each exactly the tokenizer's
encoding of the matching `memory` text. `origin` (commits only): where the row comes from, {repository, commit,
parent}, so an evaluation can rebuild the parent tree and run the repository's tests against a generated edit.
Prompts and targets are lists of parts: a part that is exactly a special token string (`<read>`) becomes that token;
everything else is text.
"""

from __future__ import annotations

import pyarrow as pa

from pipelines.format.tokenizer import EOS, SPECIAL_IDS

IGNORE = -100  # a label that takes no loss: the prompt's, and padding (torch's cross_entropy ignore_index)
ROW_SCHEMA = pa.schema([
    ("task", pa.string()), ("variant", pa.string()), ("kind", pa.string()), ("prompt", pa.string()),
    ("target", pa.string()), ("answer", pa.string()), ("memory", pa.list_(pa.string())), ("source", pa.string()),
    ("unit", pa.string()),
    ("evidence", pa.struct([("path", pa.string()), ("start_line", pa.int32()), ("end_line", pa.int32())])),
    ("evidence_chunks", pa.list_(pa.string())),
    ("depth", pa.float64()), ("memory_chunks", pa.int32()), ("memory_tokens", pa.int32()), ("diff", pa.string()),
    ("origin", pa.struct([("repository", pa.string()), ("commit", pa.string()), ("parent", pa.string())])),
    ("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32())),
    ("memory_input_ids", pa.list_(pa.list_(pa.int32()))),
])
# Dictionary-encode only the short repeated columns: trying it on unique texts and token lists tripled write time.
DICTIONARY_COLUMNS = ["task", "variant", "kind", "source", "unit"]


def make_row(*, task: str, variant: str, kind: str, prompt: list[str], target: list[str], answer: str,
             memory: list[str], memory_ids: list[list[int]], source: str, unit: str,
             evidence: tuple[str, int, int], tokenizer, depth: float | None = None, diff: str = "",
             evidence_chunks: list[str] = (), origin: dict[str, str] | None = None) -> dict:
    prompt_ids = tokenizer.encode_parts(prompt)
    target_ids = tokenizer.encode_parts(target) + [SPECIAL_IDS[EOS]]
    path, start, end = evidence
    return {
        "task": task, "variant": variant, "kind": kind, "prompt": "".join(prompt), "target": "".join(target),
        "answer": answer, "memory": memory, "source": source, "unit": unit,
        "evidence": {"path": path, "start_line": int(start), "end_line": int(end)},
        "evidence_chunks": list(evidence_chunks),
        "depth": depth, "memory_chunks": len(memory), "memory_tokens": sum(len(m) for m in memory_ids),
        "diff": diff, "origin": origin,
        "input_ids": prompt_ids + target_ids, "labels": [IGNORE] * len(prompt_ids) + target_ids,
        "memory_input_ids": memory_ids,
    }
