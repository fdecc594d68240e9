"""The traffic-domain tokenizer: a `tokenizers` WordLevel model over the questions' and commands' words.

Lower-cased, split on whitespace and punctuation; every word of `VOCABULARY` (and the scenes' question texts) has
one id, anything else is `[UNK]`. Special tokens at fixed ids: `[PAD]` 0, `[BOS]` 1, `[EOS]` 2, `[UNK]` 3, `[YES]`
4, `[NO]` 5. `encode` puts `[BOS]` in front (the post-processor), so a question's last position is where the
decoder's `[YES]`/`[NO]` logits are read. Saved as one `tokenizer.json`; the vocabulary stays within the decoder's
500 rows.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordLevel

from pipelines.data.traffic_scenes import QUESTIONS

SPECIAL_TOKENS = ("[PAD]", "[BOS]", "[EOS]", "[UNK]", "[YES]", "[NO]")
PAD, BOS, EOS, UNK, YES, NO = SPECIAL_TOKENS
MAX_VOCAB = 500

# Words of the questions and of free-form driving commands/answers (order is id order after the specials: append only).
VOCABULARY = """
? . , ! is are there a an the any of on in at to from and or not no yes it this that what which how many
light lights traffic red green yellow amber signal lamp
pedestrian pedestrians person people crosswalk crossing zebra sidewalk walking
lane lanes left right middle centre center free clear blocked occupied busy empty
car cars vehicle vehicles truck bus bike bicycle ahead behind front next
stop sign signs yield speed limit parking blue round
can could should must may go drive wait turn change keep slow down up brake accelerate continue proceed
straight forward back reverse merge pass overtake park
road street intersection junction corner scene image picture see visible
safe unsafe danger careful because until when while
one two three four zero
""".split()


def vocabulary() -> list[str]:
    """Specials, then the domain words, then any question word the list misses (deduplicated, order kept)."""
    words = list(SPECIAL_TOKENS)
    question_words = [w for q in QUESTIONS.values() for w in re.findall(r"\w+|[^\w\s]", q.lower())]
    for word in VOCABULARY + question_words:
        if word not in words:
            words.append(word)
    if len(words) > MAX_VOCAB:
        raise ValueError(f"traffic vocabulary has {len(words)} entries, more than the decoder's {MAX_VOCAB} rows")
    return words


def build_traffic_tokenizer() -> Tokenizer:
    """The WordLevel tokenizer; `encode(text).ids` starts with [BOS]."""
    vocab = {word: i for i, word in enumerate(vocabulary())}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # splits "red?" into "red", "?"
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tokenizer.enable_padding(pad_id=vocab[PAD], pad_token=PAD)
    return tokenizer


def save_traffic_tokenizer(directory: str | Path) -> Path:
    """Write `tokenizer.json` into `directory`; returns its path."""
    path = Path(directory) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    build_traffic_tokenizer().save(str(path))
    return path


def load_traffic_tokenizer(path: str | Path) -> Tokenizer:
    """A saved tokenizer: a `tokenizer.json` file or the directory holding it."""
    path = Path(path)
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


@functools.lru_cache(maxsize=1)
def traffic_tokenizer() -> Tokenizer:
    """The one tokenizer a process's batches are encoded with, built once."""
    return build_traffic_tokenizer()
