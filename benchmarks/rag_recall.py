"""How often BM25's top-k chunks (or, with --retriever, a dense retriever's) hold every chunk a needle question's
answer needs: the ceiling of any `rag` (or `dense_rag`) system on the needle suite, whatever its decoder learned
(what the top-k leaves out it can only guess, at 1 in 1,000 for three digits). Same probes as `jobs/evaluate.py`'s
needle suite (pipelines.evaluate.needle.make_probe: same seed, sizes and variants) and the same retrieval as the rag
baseline (pipelines.data.memory_modes.top_chunks over the question's tokens; dense_rag's, dense_top_chunks_each,
with --retriever). No Ray: a minute or two. Every task by default, alias and the chains among them: an alias
question shares no token with its memory, so BM25 scores every chunk 0 and keeps the memory's first k (chance).

    python benchmarks/rag_recall.py
    python benchmarks/rag_recall.py --k 1 --multipliers 1 4 --variants single variable_tracking --memories 3
    python benchmarks/rag_recall.py --retriever EXPORT    # a jobs/retriever.py export instead of BM25
    python benchmarks/rag_recall.py --reread --variants two_hop three_hop --memories 3    # an iterative rag's most

Prints a table (recall with its 95% Wilson interval per variant and memory size) and a JSON line last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipelines.data.memory_modes import dense_top_chunks_each, evidence_held, top_chunks_each
from models.retriever import RETRIEVER_FILE
from pipelines.data.synthetic_needles import BOS, VARIANTS, NeedleSpec
from pipelines.evaluate.metrics import rate_interval
from pipelines.evaluate.needle import NeedleSuite, make_probe
from pipelines.train.presets import STAGE0


def recall(variant: str, spec: NeedleSpec, multiplier: int, suite: NeedleSuite, k: int,
           hops: int = 2, retriever: str | None = None, reread: bool = False) -> tuple[int, int]:
    """(questions whose evidence chunks are all in the top k, questions) over the suite's probes of one cell, ranked
    by BM25 or by the retriever export. `reread`: also the top k for each key a chain's answer names on its way,
    asked as a question would ask it (`BOS kb`): what a reader that names its next key and retrieves again holds
    when it names every key right (the most an iterative rag could answer from)."""
    held = asked = 0
    for index in range(suite.memories):
        probe = make_probe(variant, spec, multiplier, suite.seed, index, hops, suite.hard_distractors)
        chunks = probe.memory.tolist()

        def ranked(queries: list[list[int]]) -> list[list[int]]:
            return (dense_top_chunks_each(chunks, queries, k, retriever) if retriever else
                    top_chunks_each(chunks, queries, k))

        kept = ranked(probe.questions)
        if reread:
            for q, path in enumerate(probe.paths):
                keys = [[BOS, *path[at : at + spec.key_tokens]] for at in range(0, len(path), spec.key_tokens)]
                kept[q] = [c for top in [kept[q], *(ranked(keys) if keys else [])] for c in top]
        held += sum(evidence_held(probe.evidence, kept))
        asked += len(probe.questions)
    return held, asked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=STAGE0.model.rag_k, help="chunks retrieved (the rag baseline's rag_k)")
    parser.add_argument("--multipliers", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--memories", type=int, default=NeedleSuite().memories, help="probe memories per cell")
    parser.add_argument("--retriever", help="a retriever export (jobs/retriever.py) to rank with instead of BM25")
    parser.add_argument("--reread", action="store_true",
                        help="also retrieve the top k for each key a chain's answer names (an iterative rag's most)")
    args = parser.parse_args()
    if args.retriever and not (Path(args.retriever) / RETRIEVER_FILE).is_file():
        parser.error(f"--retriever {args.retriever}: no {RETRIEVER_FILE} there; pass the export jobs/retriever.py "
                     f"printed")
    suite, spec = NeedleSuite(memories=args.memories), STAGE0.needle.spec()
    ranker = "dense retriever" if args.retriever else "BM25"
    again = ", retrieving again at each key a chain names" if args.reread else ""
    print(f"{ranker} top-{args.k} recall of every evidence chunk{again}, {args.memories} probe memories a cell "
          f"(training memory: {spec.chunks} chunks of {spec.chunk_len} tokens)")
    print("| task | " + " | ".join(f"{m}x" for m in args.multipliers) + " |")
    print("|---|" + "---|" * len(args.multipliers))
    rows = {}
    for variant in args.variants:
        for hops in (suite.hops if variant == "variable_tracking" else [2]):
            name = f"{variant}_{hops}" if variant == "variable_tracking" else variant
            cells = [recall(variant, spec, m, suite, args.k, hops, args.retriever, args.reread)
                     for m in args.multipliers]
            rows[name] = {f"{m}x": round(held / asked, 4) for m, (held, asked) in zip(args.multipliers, cells)}
            shown = []
            for held, asked in cells:
                low, high = rate_interval(held, asked)
                shown.append(f"{held / asked:.2f} ({low:.2f}-{high:.2f})")
            print(f"| {name} | " + " | ".join(shown) + " |")
    print(json.dumps({"benchmark": "rag_recall", "retriever": "dense" if args.retriever else "bm25", "k": args.k,
                      "reread": args.reread, "memories": args.memories, "recall": rows}))


if __name__ == "__main__":
    main()
