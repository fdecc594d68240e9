"""Memory-conditioned generation with a pair: the same prompt, several memories, and no memory.

    python jobs/generate.py                       # tiny random pair on CPU, gates as built (closed)
    python jobs/generate.py --gate 0.5            # open the gates: each memory now changes the answer
    python jobs/generate.py --model_dir DIR       # a model written by AwarenessModel.save_pretrained

Prints a table, then a one-line JSON summary as the last line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from models import PAIRS, AwarenessModel, build_pair
from pipelines.cli import parse_config
from pipelines.evaluate.generation import generate_with_memories


@dataclass
class GenerateArgs:
    pair: str = "tiny"  # a name from models.PAIRS; real pairs read $AWARENESS_CHECKPOINT_ROOT
    model_dir: str | None = None  # load a saved AwarenessModel instead of building the pair
    checkpoint_root: str | None = None  # where the pair's checkpoints live (tiny pairs are written there)
    gate: float | None = None  # set every GCA gate to this value first (0 = the pretrained decoder)
    memories: int = 2  # how many random memories to answer the prompt with
    chunks: int = 4  # chunks per memory
    chunk_len: int = 32  # tokens per chunk
    prompt_len: int = 8  # random prompt tokens
    max_new_tokens: int = 16  # tokens generated after the prompt
    num_beams: int = 1  # 1: greedy; more: beam search (transformers' generate)
    seed: int = 0  # seeds the random prompt and memory

    def problems(self) -> list[str]:
        p = [] if self.pair in PAIRS else [f"pair {self.pair!r} is not one of {sorted(PAIRS)}"]
        counts = ("memories", "chunks", "chunk_len", "prompt_len", "max_new_tokens", "num_beams")
        return p + [f"{name} must be positive" for name in counts if getattr(self, name) <= 0]


def main(argv: list[str] | None = None) -> dict:
    args = parse_config(argv, GenerateArgs(), description=__doc__)
    torch.manual_seed(args.seed)
    model = (AwarenessModel.from_pretrained(args.model_dir) if args.model_dir
             else build_pair(args.pair, checkpoint_root=args.checkpoint_root))
    if args.gate is not None:
        with torch.no_grad():
            for block in model.gca_blocks().values():
                block.gate.fill_(args.gate)
    encoder_vocab = model.memory_encoder.encoder.config.vocab_size
    prompt = torch.randint(0, model.decoder.config.vocab_size, (args.prompt_len,))
    memories = torch.randint(0, encoder_vocab, (args.memories, args.chunks, args.chunk_len))
    report = generate_with_memories(model, prompt, memories, max_new_tokens=args.max_new_tokens,
                                    num_beams=args.num_beams)
    for i, continuation in enumerate(report.with_memory):
        print(f"memory {i}: {continuation}")
    print(f"no memory: {report.without_memory}")
    summary = {"job": "generate", "pair": args.pair, "gca_layers": model.gca_layers,
               "gates": [round(v, 4) for v in model.gate_values().values()], **report.summary()}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
