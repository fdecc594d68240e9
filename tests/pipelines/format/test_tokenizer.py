"""The offline Qwen3 tokenizer gives tiktoken's ids for Qwen's ranks and regex, round-trips, and keeps its special
ids where Qwen3 and the decoders expect them; a checkpoint's tokenizer.json gives the same ids."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest
import tiktoken
from tokenizers import Tokenizer, normalizers

from pipelines.format import chunking
from pipelines.format.tokenizer import (AGENT_SPECIAL, N_RANKS, QWEN3_SPECIAL, QWEN_PATTERN, SPECIAL_IDS, VOCAB_SIZE,
                                         QwenTokenizer, dashscope_ranks_path, load_ranks, text_tokenizer,
                                         tokenizers_tokenizer)


def real_texts(package_roots) -> list[str]:
    files = sorted(p for root in package_roots.values() for p in root.rglob("*.py"))
    texts = [p.read_text(encoding="utf-8") for p in files]
    # accents, NFC, CJK, emoji, odd whitespace
    texts.append("Ünïcödé naïve café — 漢字かな 🙂 e\u0301\n\t\r\n  x  \n")
    return texts


def test_same_ids_as_plain_tiktoken_on_real_source(tokenizer, package_roots):
    plain = tiktoken.Encoding("plain", pat_str=QWEN_PATTERN, mergeable_ranks=load_ranks(), special_tokens={})
    texts = real_texts(package_roots)
    assert sum(map(len, texts)) > 300_000
    for text in texts:
        ids = tokenizer.encode_text(text)
        assert ids == plain.encode_ordinary(unicodedata.normalize("NFC", text))
        assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_same_ids_as_plain_tiktoken_on_random_unicode(tokenizer):
    """The fast encoder's PCRE2 pre-tokenizer against tiktoken's regex where they could disagree: every Unicode
    category, the whitespace Qwen's regex treats specially (CRLF, NBSP, U+2028, vertical tab, U+0085), contractions,
    combining marks, special-token strings."""
    plain = tiktoken.Encoding("plain", pat_str=QWEN_PATTERN, mergeable_ranks=load_ranks(), special_tokens={})
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0x20, 0x30000, 7) if unicodedata.category(chr(c)) not in ("Cs", "Cn")]
    spaces = [" ", "  ", "\t", "\n", "\r", "\r\n", "\n\n", "\x0b", "\x0c", "\x85", "\xa0", "\u2028", "\u3000", "\u200b"]
    common = [*"abcXYZ0123_'\"()[]{}.,;:-+=/\\#@!?<>|", "'s", "'LL", "<|im_end|>", "<think>", "e\u0301", "日本語"]
    for _ in range(3000):
        pools = [rng.choice((alphabet, spaces, common)) for _ in range(rng.randint(1, 40))]
        text = "".join(rng.choice(pool) for pool in pools)
        assert tokenizer.encode_text(text) == plain.encode_ordinary(unicodedata.normalize("NFC", text)), repr(text)


def test_special_ids_are_qwen3s_and_ours_are_stable():
    assert len(load_ranks()) == N_RANKS == 151_643
    assert len(QWEN3_SPECIAL) == 26
    assert SPECIAL_IDS["<|endoftext|>"] == 151643 and SPECIAL_IDS["<|im_start|>"] == 151644
    assert SPECIAL_IDS["<|im_end|>"] == 151645 and SPECIAL_IDS["<think>"] == 151667
    assert SPECIAL_IDS["</think>"] == 151668
    assert [SPECIAL_IDS[t] for t in AGENT_SPECIAL] == list(range(151669, 151669 + len(AGENT_SPECIAL)))
    assert max(SPECIAL_IDS.values()) < 151936  # inside every Qwen3 decoder's embedding rows


def test_a_templates_text_is_encoded_as_one_text(tokenizer):
    """A prompt built from parts gets the ids its joined text gets, so a served prompt (a string) matches training."""
    parts = ["Fix the parser.", "\nFile: a.py\n", "@@ -1,2 +1,3 @@", "\n"]
    assert tokenizer.encode_parts(parts) == tokenizer.encode_text("".join(parts))
    assert tokenizer.encode_parts(parts) != [i for p in parts for i in tokenizer.encode_text(p)]  # ".\n", "@@\n"
    assert tokenizer.encode_parts(["a.", "<read>", "\n", "b"]) == [
        *tokenizer.encode_text("a."), SPECIAL_IDS["<read>"], *tokenizer.encode_text("\nb")]


def test_special_strings_in_text_stay_text(tokenizer):
    """A repository that contains `<read>` or `<|im_end|>` cannot inject control tokens into a memory."""
    ids = tokenizer.encode_text("x = '<read>' + '<|im_end|>'")
    assert not set(ids) & set(SPECIAL_IDS.values())
    parts = tokenizer.encode_parts(["<read>", "a.py [chunk 0]", "</read>", "42"])
    assert parts[0] == SPECIAL_IDS["<read>"] and SPECIAL_IDS["</read>"] in parts
    assert tokenizer.decode(parts) == "<read>a.py [chunk 0]</read>42"


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """A Qwen3-style tokenizer.json (byte-level BPE, Qwen regex, NFC, added tokens) converted from the same ranks
    by transformers' own TikTokenConverter: stands in for a local checkpoint, which this machine cannot download."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(dashscope_ranks_path()), pattern=QWEN_PATTERN,
                            extra_special_tokens={t: i for i, t in enumerate(QWEN3_SPECIAL)}).converted()
    tok.normalizer = normalizers.NFC()
    root = tmp_path_factory.mktemp("qwen3-checkpoint")
    tok.save(str(root / "tokenizer.json"))
    return root


def test_checkpoint_tokenizer_matches_offline(checkpoint_dir, tokenizer, package_roots):
    hf = QwenTokenizer(checkpoint_dir)
    for text in real_texts(package_roots)[::7]:
        assert hf.encode_text(text) == tokenizer.encode_text(text)
    parts = ["Q?\n", "<read>", "x.py [chunk 1]", "</read>", "<think>"]
    assert hf.encode_parts(parts) == tokenizer.encode_parts(parts)
    assert hf.decode(hf.encode_parts(parts)) == "".join(parts)


def test_checkpoint_tokenizer_chunks_like_offline(checkpoint_dir, tokenizer, package_roots):
    """The chunker finds token ends from each backend's byte lengths; both backends cut the same chunks."""
    hf = QwenTokenizer(checkpoint_dir)
    assert (hf.token_byte_lengths()[:151643] == tokenizer.token_byte_lengths()[:151643]).all()
    for text in real_texts(package_roots)[::11]:
        assert chunking.same_chunks(chunking.chunk_file("f.py", text, hf), chunking.chunk_file("f.py", text, tokenizer))


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory):
    """tokenizers_tokenizer() saved as tokenizer.json: what the registry writes beside tiny-text's decoder."""
    directory = tmp_path_factory.mktemp("tiny-qwen3-text")
    tokenizers_tokenizer().save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def converted(converted_dir):
    return Tokenizer.from_file(str(converted_dir / "tokenizer.json"))


def test_tokenizer_json_gives_the_offline_ids_and_text(converted, converted_dir, tokenizer, package_roots):
    """Memory text (special-token strings read as text, `encode_special_tokens`), templates (every special token at
    its id) and decoding: the same as the tiktoken tokenizer, on real source."""
    assert converted.get_vocab_size() == VOCAB_SIZE
    assert {t: converted.token_to_id(t) for t in SPECIAL_IDS} == SPECIAL_IDS
    as_text = Tokenizer.from_str(converted.to_str())
    as_text.encode_special_tokens = True
    texts = real_texts(package_roots) + ["x = '<read>' + '<|im_end|>' # <think>\n"]
    for text in texts:
        ids = tokenizer.encode_text(text)
        assert as_text.encode(text, add_special_tokens=False).ids == ids
        assert converted.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)
    assert not set(as_text.encode(texts[-1]).ids) & set(SPECIAL_IDS.values())
    source = texts[0][:2000]
    parts = [part for special in SPECIAL_IDS for part in (special, source[: len(special) * 7])]  # every special token
    ids = tokenizer.encode_parts(parts)
    assert converted.encode("".join(parts)).ids == ids and set(SPECIAL_IDS.values()) <= set(ids)
    assert converted.decode(ids, skip_special_tokens=False) == tokenizer.decode(ids) == "".join(parts)
    assert QwenTokenizer(converted_dir).encode_parts(parts) == ids  # the corpus builder accepts it as a checkpoint


QWEN3_UNMARKED = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                  "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>")


def test_added_tokens_a_checkpoint_leaves_unmarked_stay_text(tmp_path, tokenizer, package_roots):
    """Qwen3's own tokenizer.json marks `<think>`, `<tool_call>`, ... as not special; `encode_special_tokens` alone
    would let them match inside a mined file. The corpus builder and the served model still read them as text."""
    spec = json.loads(tokenizers_tokenizer().to_str())
    for token in spec["added_tokens"]:
        token["special"] = token["content"] not in QWEN3_UNMARKED
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw.encode_special_tokens = True
    text = "def f():\n    return '<think>' + \"<tool_call>\" + '<|im_end|>'  # <|file_sep|></think>\n"
    assert SPECIAL_IDS["<think>"] in raw.encode(text, add_special_tokens=False).ids  # the hazard is real
    checkpoint = QwenTokenizer(tmp_path)
    served = text_tokenizer(Tokenizer.from_file(str(tmp_path / "tokenizer.json")))
    for sample in [text, *real_texts(package_roots)[::13]]:
        ids = tokenizer.encode_text(sample)
        assert checkpoint.encode_text(sample) == ids == served.encode(sample, add_special_tokens=False).ids
    assert not set(tokenizer.encode_text(text)) & set(SPECIAL_IDS.values())
    parts = ["Q?\n", "<think>", "plan", "</think>", "<read>", "a.py [chunk 0]", "</read>"]
    assert checkpoint.encode_parts(parts) == tokenizer.encode_parts(parts)  # templates still place them by id
    assert served.get_vocab_size() == VOCAB_SIZE and served.token_to_id("<think>") == SPECIAL_IDS["<think>"]


def test_missing_checkpoint_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        QwenTokenizer(tmp_path)
