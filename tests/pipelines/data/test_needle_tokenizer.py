"""The needles' ids as words (pipelines/data/needle_tokenizer.py): every memory and prompt of stage 0 reads back to
its ids, `<bos>` is prepended, a word outside the vocabulary is `<unk>`, values are the numbers 0..89."""

from __future__ import annotations

from pipelines.data.needle_tokenizer import NEEDLE_SPECIALS, needle_tokenizer
from pipelines.data.synthetic_needles import (BOS, EOS, EQ, FILLER, KEYS, PAD, PROMPT_LEN, SEP, VALUES, NeedleSpec,
                                             make_example)


def test_needle_tokenizer_maps_text_to_the_training_ids():
    tokenizer = needle_tokenizer()
    example = make_example(NeedleSpec(), seed=7, index=3)
    for chunk in example["memory"]:
        text = tokenizer.decode(chunk.tolist())
        assert tokenizer.encode(text, add_special_tokens=False).ids == chunk.tolist()
    prompt = example["input_ids"][0, :PROMPT_LEN].tolist()  # BOS key
    assert tokenizer.encode(tokenizer.decode(prompt[1:])).ids == prompt
    assert tokenizer.decode([1, 117, 2, 14, 10, 17, 3, 4], skip_special_tokens=True) == "k117 = 4 0 7 ;"


def test_the_vocabulary_by_hand():
    tokenizer = needle_tokenizer()
    assert NEEDLE_SPECIALS == {"<pad>": PAD, "<bos>": BOS, "=": EQ, ";": SEP, "<eos>": EOS, "<unk>": 5}
    assert tokenizer.encode("k100 = 0 89 ; w300 w495").ids == [BOS, KEYS.start, EQ, VALUES.start, 99, SEP,
                                                               FILLER.start, FILLER.stop - 1]
    assert tokenizer.encode("k117 = banana", add_special_tokens=False).ids == [117, EQ, 5]  # not a needle word
    assert tokenizer.get_vocab_size() == len(NEEDLE_SPECIALS) + len(VALUES) + len(KEYS) + len(FILLER)
