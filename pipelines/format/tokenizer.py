"""The Qwen3 tokenizer for corpora: exact ids, fastest path, offline.

Without a checkpoint: the BPE ranks that the PyPI package `dashscope` ships (`dashscope/resources/qwen.tiktoken`,
151,643 ranks = Qwen3's regular token ids), Qwen's pre-tokenizer regex and NFC normalisation (both as in
transformers' `Qwen2Tokenizer`), Qwen3's 26 added tokens at 151643-151668, and this project's agentic tokens above
them. Text is encoded by `fastokens` (tiktoken's algorithm in Rust with a PCRE2-JIT pre-tokenizer; the same ids as a
`tiktoken.Encoding` of these ranks and regex, tested on real source and random Unicode, and 10x+ faster on this
machine); tiktoken decodes. With a local checkpoint directory: its `tokenizer.json` through `tokenizers` (never
`trust_remote_code`, never a download), the same agentic tokens at the same ids.

The agentic tokens are defined here and only here; their ids are stable (Qwen3's 151669 onwards, inside the
decoders' 151936 embedding rows). Memory chunks never contain special tokens (`encode_text` treats every string
as text), so a repository that mentions `<think>` cannot inject control tokens.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import fastokens
import numpy as np
import tiktoken
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

# Qwen's pre-tokenizer (transformers/models/qwen2/tokenization_qwen2.py PRETOKENIZE_REGEX): single digits.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
N_RANKS = 151_643

# Qwen3's added tokens, in id order from 151643 (Qwen3 tokenizer_config.json added_tokens_decoder).
QWEN3_SPECIAL = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
# This project's agentic tokens, appended after Qwen3's: append only, never reorder (ids are baked into data).
AGENT_SPECIAL = ("<read>", "</read>", "<plan>", "</plan>", "<edit>", "</edit>")
SPECIAL_IDS: dict[str, int] = {tok: N_RANKS + i for i, tok in enumerate(QWEN3_SPECIAL + AGENT_SPECIAL)}
EOS = "<|im_end|>"  # ends every target (Qwen3's end of turn)
PAD = "<|endoftext|>"  # pads a batch of generations (Qwen3's pad token)
READ, END_READ, PLAN, END_PLAN, EDIT, END_EDIT = AGENT_SPECIAL
VOCAB_SIZE = N_RANKS + len(SPECIAL_IDS)  # 151675 <= 151936 decoder rows


def dashscope_ranks_path() -> Path:
    """Where dashscope's copy of Qwen's BPE ranks lies (found without importing dashscope, which is an API client)."""
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the offline Qwen3 tokenizer needs the BPE ranks shipped by `dashscope`: "
                           "pip install dashscope (or pass a local Qwen3 checkpoint directory holding tokenizer.json)")
    path = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: reinstall dashscope, or pass a Qwen3 checkpoint directory")
    return path


@functools.lru_cache(maxsize=2)
def load_ranks(path: str | None = None) -> dict[bytes, int]:
    ranks = {}
    for line in Path(path or dashscope_ranks_path()).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != N_RANKS or sorted(ranks.values()) != list(range(N_RANKS)):
        raise RuntimeError(f"expected {N_RANKS} ranks 0..{N_RANKS - 1} in {path}, found {len(ranks)}")
    return ranks


class QwenTokenizer:
    """`encode_text` / `encode_array` (ordinary text, NFC), `encode_parts` (text pieces and whole special-token
    strings), `decode`. Picklable (rebuilt lazily in each Ray worker)."""

    def __init__(self, checkpoint: str | Path | None = None):
        self.checkpoint = str(checkpoint) if checkpoint else None
        if self.checkpoint and not (Path(self.checkpoint) / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{self.checkpoint}/tokenizer.json not found: pass a local Qwen3 checkpoint "
                                    "directory, or no checkpoint for the offline tokenizer")
        self._backend = None
        self._decoder = None
        self._lengths = None

    def __getstate__(self):
        return {"checkpoint": self.checkpoint, "_backend": None, "_decoder": None, "_lengths": None}

    @property
    def name(self) -> str:
        return f"tokenizers:{self.checkpoint}" if self.checkpoint else "fastokens:dashscope/qwen.tiktoken"

    def backend(self):
        """The encoder: a checkpoint's `tokenizers.Tokenizer`, or fastokens over the offline ranks. The offline one
        knows no special tokens at all, so no text can encode to one; `encode_parts` places them by id."""
        if self._backend is None:
            if self.checkpoint:
                tok = Tokenizer.from_file(str(Path(self.checkpoint) / "tokenizer.json"))
                check_special_ids(tok)
                self._backend = text_tokenizer(tok)
            else:
                load_ranks()  # checks the file holds Qwen's 151,643 ranks before fastokens reads it
                self._backend = fastokens.Tokenizer.from_tiktoken(str(dashscope_ranks_path()), pattern=QWEN_PATTERN,
                                                                  special_tokens={})
        return self._backend

    def encode_text(self, text: str) -> list[int]:
        """Ordinary text: special-token strings inside it are encoded as text, never as control tokens."""
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """`encode_text` as an int32 array, built without a Python int per token (the corpus hot path: token
        columns go to Arrow from arrays)."""
        backend = self.backend()
        if self.checkpoint:
            return np.asarray(backend.encode(text, add_special_tokens=False).ids, dtype=np.int32)
        ids, _ = backend.encode_batch_flat([unicodedata.normalize("NFC", text)])
        return np.frombuffer(ids, dtype=np.uint32).view(np.int32)  # ids < 2**31

    def token_byte_lengths(self) -> np.ndarray:
        """Bytes each id decodes to (special tokens: their string's), so a chunker can find where a token ends in
        the text without decoding: `cumsum(lengths[ids])` are the tokens' end offsets."""
        if self._lengths is None:
            lengths = np.zeros(VOCAB_SIZE, dtype=np.int32)
            if self.checkpoint:
                byte_chars = set(pre_tokenizers.ByteLevel.alphabet())  # ByteLevel BPE: one character per byte
                for token, i in self.backend().get_vocab(with_added_tokens=False).items():
                    if i < VOCAB_SIZE:
                        lengths[i] = sum(1 for c in token if c in byte_chars)
            else:
                for token, i in load_ranks().items():
                    lengths[i] = len(token)
            for token, i in SPECIAL_IDS.items():
                lengths[i] = len(token.encode())
            self._lengths = lengths
        return self._lengths

    def encode_parts(self, parts: list[str]) -> list[int]:
        """A template: each part that is exactly a special-token string becomes that token; the text between is
        encoded as one text, so a prompt's ids are those of its text (what a served model gets from the string:
        `"Fix it."` then `"\n"` is one `.\n` token, not two)."""
        ids: list[int] = []
        text: list[str] = []
        for part in [*parts, None]:
            if part is None or part in SPECIAL_IDS:
                if text:
                    ids.extend(self.encode_text("".join(text)))
                    text = []
                if part is not None:
                    ids.append(SPECIAL_IDS[part])
            else:
                text.append(part)
        return ids

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if not self.checkpoint:
            if self._decoder is None:
                self._decoder = tiktoken.Encoding("qwen3", pat_str=QWEN_PATTERN, mergeable_ranks=load_ranks(),
                                                  special_tokens=SPECIAL_IDS)
            return self._decoder.decode(ids)
        backend = self.backend()
        inverse = {v: k for k, v in SPECIAL_IDS.items()}
        out, run = [], []
        for i in ids:  # the checkpoint may lack the agentic tokens: decode them from our table
            if i in inverse and i >= N_RANKS + len(QWEN3_SPECIAL):
                out.append(backend.decode(run, skip_special_tokens=False))
                out.append(inverse[i])
                run = []
            else:
                run.append(i)
        out.append(backend.decode(run, skip_special_tokens=False))
        return "".join(out)


@functools.lru_cache(maxsize=4)
def cached_tokenizer(checkpoint: str | None = None) -> QwenTokenizer:
    """One tokenizer per worker process (building the offline one reads 151,643 ranks, ~0.4 s)."""
    return QwenTokenizer(checkpoint)


def text_tokenizer(tok):
    """A `tokenizers.Tokenizer` that reads every string as text, as `encode_text` does: no added token matches inside
    it. `encode_special_tokens` covers only added tokens marked special, and Qwen3's own tokenizer.json leaves some
    unmarked (`<think>`, `<tool_call>`, ...), which would otherwise become control tokens inside a mined file or a
    memory chunk; they are marked here (no id changes). For templates, use the tokenizer as loaded."""
    unmarked = [t for t in tok.get_added_tokens_decoder().values() if not t.special]
    tok.add_special_tokens([AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                                       normalized=t.normalized, special=True) for t in unmarked])
    tok.encode_special_tokens = True
    return tok


def tokenizers_tokenizer():
    """The offline tokenizer as a `tokenizers.Tokenizer`, i.e. what a Qwen3 checkpoint's tokenizer.json holds: the
    same ranks as byte-level BPE (transformers' TikTokenConverter; `ignore_merges`, so a whole pre-token found in the
    vocabulary is one token, as in tiktoken), Qwen's regex, NFC, and every special token at its id here. For the
    random-weight checkpoints with Qwen3's vocabulary, which have no tokenizer of their own. All added tokens are
    `special`, so `encode_special_tokens=True` reads them as text, exactly as `encode_text` does (for a real
    checkpoint's tokenizer.json, which leaves some unmarked, `text_tokenizer` marks them)."""
    # lazy: transformers (~2.5 s); corpus builders and their workers import this module and need none of it
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
            return load_ranks(tiktoken_url)

    tok = Converter(vocab_file=None, pattern=QWEN_PATTERN).converted()  # None: load_ranks' dashscope copy
    tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_IDS])  # in id order
    if any(tok.token_to_id(t) != i for t, i in SPECIAL_IDS.items()) or tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"converted tokenizer has {tok.get_vocab_size()} ids, expected {VOCAB_SIZE}")
    return tok


def check_special_ids(tok) -> None:
    """A checkpoint's tokenizer must put Qwen3's added tokens (and ours, if it has them) at our ids."""
    wrong = [f"{t}: {tok.token_to_id(t)} != {i}" for t, i in SPECIAL_IDS.items()
             if tok.token_to_id(t) is not None and tok.token_to_id(t) != i]
    missing = [t for t in QWEN3_SPECIAL if tok.token_to_id(t) is None]
    if wrong or missing:
        raise ValueError(f"not a Qwen3 tokenizer: special ids differ ({'; '.join(wrong)}) or missing ({missing})")


def describe(tokenizer: QwenTokenizer) -> dict:
    """What the manifest records about the tokenizer, so a reader can check the ids it trains on."""
    return {"name": tokenizer.name, "special_ids": SPECIAL_IDS, "vocab_size": VOCAB_SIZE, "eos": EOS}


# ------------------------------------------------------------------------------------- UL2's tokenizers
# The encoder-decoder's UL2 job tokenizes with `tokenizers`: a byte-level one for the tiny random checkpoint, or the
# real checkpoint's tokenizer.json with UL2's mode tokens and sentinels added.
TOKENIZER_FILE = "tokenizer.json"
UL2_SPECIALS = ("<pad>", "<s>", "</s>", "[R]", "[S]", "[X]")  # padding, decoder start, end, the UL2 mode tokens
UL2_SENTINELS = 100  # <extra_id_0> ... <extra_id_99>: one per corrupted span


def write_byte_tokenizer(directory: str | Path) -> Path:
    """A real `tokenizers` byte-level tokenizer: 256 byte tokens (ids 0-255), then UL2_SPECIALS and the sentinels
    (362 ids: fits the tiny checkpoints' 512-row vocabulary). Any text round-trips; no download."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    tokenizer = Tokenizer(BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([*UL2_SPECIALS, *(f"<extra_id_{i}>" for i in range(UL2_SENTINELS))])
    path = Path(directory) / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def _byte_of(char: str) -> int:
    """GPT-2's byte-to-unicode map, inverted: printable bytes map to themselves, the rest to 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if ord(char) in printable:
        return ord(char)
    rest = [b for b in range(256) if b not in printable]
    return rest[ord(char) - 256]


@dataclass(frozen=True)
class Ul2Vocab:
    """The token ids the denoisers write."""

    pad: int
    start: int
    eos: int
    modes: dict[str, int]
    sentinels: tuple[int, ...]


def load_tokenizer(checkpoint: str | Path, vocab_size: int):
    """The checkpoint's tokenizer.json, with the UL2 specials added when it lacks them (a real Qwen3 tokenizer gets
    them in its unused rows, ids 151669+); refuses ids the model has no row for."""
    path = Path(checkpoint) / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(checkpoint)!r} has no {TOKENIZER_FILE}: UL2 tokenizes with the checkpoint's own "
                                f"tokenizer (a Hugging Face Qwen3 download has one)")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.add_special_tokens([*UL2_SPECIALS[3:], *(f"<extra_id_{i}>" for i in range(UL2_SENTINELS))])
    if tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise ValueError(f"the tokenizer with UL2's {len(UL2_SPECIALS) - 3 + UL2_SENTINELS} added tokens has "
                         f"{tokenizer.get_vocab_size(with_added_tokens=True)} ids but the model {vocab_size} rows: "
                         f"resize the model's embeddings (model.resize_token_embeddings) before training")
    return tokenizer


def ul2_vocab(tokenizer) -> Ul2Vocab:
    """Our byte tokenizer's <pad>/<s>/</s>, or Qwen3's <|endoftext|> (pad and start) and <|im_end|> (end)."""
    ids = tokenizer.token_to_id
    pad = ids("<pad>") if ids("<pad>") is not None else ids("<|endoftext|>")
    start = ids("<s>") if ids("<s>") is not None else ids("<|endoftext|>")
    eos = ids("</s>") if ids("</s>") is not None else ids("<|im_end|>")
    if None in (pad, start, eos):
        raise ValueError("the tokenizer has neither <pad>/<s>/</s> nor Qwen3's <|endoftext|>/<|im_end|>")
    return Ul2Vocab(pad=pad, start=start, eos=eos, modes={m: ids(f"[{m}]") for m in "RSX"},
                    sentinels=tuple(ids(f"<extra_id_{i}>") for i in range(UL2_SENTINELS)))


