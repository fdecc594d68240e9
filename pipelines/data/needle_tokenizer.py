"""The stage-0 needles' ids as text (pipelines.data.synthetic_needles): what lets a served or evaluated needle model
take questions as words. `<bos>` `k117` `=` digits `;` `<eos>`, filler `w300`, values read as numbers 0..89."""

from __future__ import annotations

from tokenizers import Tokenizer, pre_tokenizers, processors
from tokenizers import models as tokenizer_models

from pipelines.data.synthetic_needles import FILLER, KEYS, VALUES

NEEDLE_SPECIALS = {"<pad>": 0, "<bos>": 1, "=": 2, ";": 3, "<eos>": 4, "<unk>": 5}


def needle_tokenizer():
    """A `tokenizers` WordLevel tokenizer over the needle vocabulary; `<bos>` prepended to every encoding."""
    vocab = dict(NEEDLE_SPECIALS)
    vocab |= {str(v - VALUES.start): v for v in VALUES}  # values read as numbers 0..89
    vocab |= {f"k{k}": k for k in KEYS} | {f"w{w}": w for w in FILLER}
    tokenizer = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    tokenizer.add_special_tokens(["<pad>", "<bos>", "<eos>", "<unk>"])
    return tokenizer
