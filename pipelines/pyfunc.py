"""The MLflow pyfunc model: question + memory chunk texts in, generated answer text out.

It holds only the small exported artifact (GCA, projection, LoRA); `load_context` rebuilds the model from the base
checkpoints that artifact names (`AwarenessModel.from_pretrained`), so no copy of the base weights is logged.
Text goes through the decoder checkpoint's own `tokenizer.json` (real Qwen3 checkpoints carry one; Qwen3-Embedding
shares its vocabulary, so memory chunks use it too). The random-weight pairs carry none: for them the registry
writes `needle_tokenizer()`, a WordLevel tokenizer over stage 0's needle vocabulary, beside the generated checkpoint,
so a needle question is text too (`k117 =` -> `4 0 7`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow.pyfunc
import torch

TOKENIZER_FILE = "tokenizer.json"
NEEDLE_SPECIALS = {"<pad>": 0, "<bos>": 1, "=": 2, ";": 3, "<eos>": 4, "<unk>": 5}


def needle_tokenizer():
    """pipelines.needle's ids as words: `<bos>` `k117` `=` digits `;` `<eos>`, filler `w300`..; `<bos>` prepended."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from pipelines.needle import FILLER, KEYS, VALUES

    vocab = dict(NEEDLE_SPECIALS)
    vocab |= {str(v - VALUES.start): v for v in VALUES}  # values read as numbers 0..89
    vocab |= {f"k{k}": k for k in KEYS} | {f"w{w}": w for w in FILLER}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tokenizer.add_special_tokens(["<pad>", "<bos>", "<eos>", "<unk>"])
    return tokenizer


def ensure_tokenizer(decoder_dir: str | Path) -> Path:
    """The decoder checkpoint's tokenizer.json; for a random-weight checkpoint, the needle tokenizer written there."""
    from models.pairs import RANDOM_WEIGHTS_MARKER

    decoder_dir = Path(decoder_dir)
    path = decoder_dir / TOKENIZER_FILE
    if not path.is_file():
        if not (decoder_dir / RANDOM_WEIGHTS_MARKER).is_file():
            raise FileNotFoundError(
                f"{decoder_dir} has no {TOKENIZER_FILE}: the pyfunc model turns text into ids with the decoder "
                f"checkpoint's tokenizer; copy the checkpoint's tokenizer.json there"
            )
        needle_tokenizer().save(str(path))
    return path


class AwarenessPyfunc(mlflow.pyfunc.PythonModel):
    """predict(rows of {question: str, memory: list[str]}) -> list of answers (greedy, memory read through GCA)."""

    def load_context(self, context) -> None:
        from tokenizers import Tokenizer

        from models import AwarenessModel

        self.model = AwarenessModel.from_pretrained(context.artifacts["export"]).eval()
        self.tokenizer = Tokenizer.from_file(str(Path(self.model.config.decoder) / TOKENIZER_FILE))
        settings = context.model_config or {}
        self.max_new_tokens = int(settings.get("max_new_tokens", 32))
        eos = settings.get("eos_token")
        self.eos_token_id = self.tokenizer.token_to_id(eos) if eos else self.model.decoder.generation_config.eos_token_id
        self.pad_token_id = self.tokenizer.token_to_id(settings.get("pad_token") or "<pad>") or 0

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[str]:
        max_new_tokens = int((params or {}).get("max_new_tokens") or self.max_new_tokens)
        return [self.answer(question, list(memory), max_new_tokens) for question, memory in _rows(model_input)]

    def encode(self, question: str, memory: list[str]) -> dict[str, torch.Tensor]:
        """Prompt ids (1, T); memory ids and mask (1, chunks, longest chunk), right-padded."""
        prompt = torch.tensor([self.tokenizer.encode(question).ids])
        chunks = [self.tokenizer.encode(text, add_special_tokens=False).ids for text in memory]
        if not chunks:
            return {"input_ids": prompt}
        width = max(len(c) for c in chunks)
        ids = torch.full((1, len(chunks), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((1, len(chunks), width), dtype=torch.long)
        for i, chunk in enumerate(chunks):
            ids[0, i, : len(chunk)], mask[0, i, : len(chunk)] = torch.tensor(chunk), 1
        return {"input_ids": prompt, "memory_input_ids": ids, "memory_attention_mask": mask}

    def answer(self, question: str, memory: list[str], max_new_tokens: int) -> str:
        inputs = self.encode(question, memory)
        out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        return self.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:].tolist(), skip_special_tokens=True)


def _rows(model_input) -> list[tuple[str, list[str]]]:
    """A DataFrame with columns question and memory, a dict, or a list of dicts."""
    if hasattr(model_input, "to_dict"):
        model_input = model_input.to_dict(orient="records")
    if isinstance(model_input, dict):
        model_input = [model_input]
    rows = []
    for row in model_input:
        if "question" not in row:
            raise ValueError(f"each input needs a 'question' (text) and a 'memory' (list of chunk texts); got {sorted(row)}")
        memory = row.get("memory")
        rows.append((str(row["question"]), [] if memory is None else [str(m) for m in memory]))
    return rows


def signature():
    from mlflow.models import ModelSignature
    from mlflow.types.schema import Array, ColSpec, DataType, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec(DataType.string, "question"), ColSpec(Array(DataType.string), "memory")]),
        outputs=Schema([ColSpec(DataType.string)]),
        params=ParamSchema([ParamSpec("max_new_tokens", DataType.long, 0)]),
    )
