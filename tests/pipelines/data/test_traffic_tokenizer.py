"""The traffic tokenizer: special tokens at fixed ids, every question in vocabulary, round trips, saved and loaded."""

from __future__ import annotations

from pipelines.data.traffic_scenes import QUESTIONS
from pipelines.data.traffic_tokenizer import (MAX_VOCAB, SPECIAL_TOKENS, build_traffic_tokenizer,
                                              load_traffic_tokenizer, save_traffic_tokenizer)


def test_special_tokens_at_fixed_ids_and_vocab_bound():
    tokenizer = build_traffic_tokenizer()
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert {"[YES]", "[NO]", "[PAD]", "[BOS]", "[EOS]"} <= set(tokenizer.get_vocab())
    assert tokenizer.get_vocab_size() <= MAX_VOCAB


def test_questions_round_trip_without_unknowns():
    tokenizer = build_traffic_tokenizer()
    unk = tokenizer.token_to_id("[UNK]")
    for question in list(QUESTIONS.values()) + ["Turn left and stop at the crosswalk.", "Slow down, pedestrian ahead!"]:
        encoding = tokenizer.encode(question)
        assert encoding.ids[0] == tokenizer.token_to_id("[BOS]")
        assert unk not in encoding.ids, question
        text = tokenizer.decode(encoding.ids)
        assert tokenizer.encode(text).ids == encoding.ids
        assert text.replace(" ", "") == question.lower().replace(" ", "")


def test_special_tokens_encode_as_one_id_and_unknown_words_as_unk():
    tokenizer = build_traffic_tokenizer()
    ids = tokenizer.encode("is the light red ? [YES] [EOS]").ids
    assert ids[-2:] == [tokenizer.token_to_id("[YES]"), tokenizer.token_to_id("[EOS]")]
    assert tokenizer.encode("flamingo").ids == [tokenizer.token_to_id("[BOS]"), tokenizer.token_to_id("[UNK]")]


def test_batch_pads_with_pad_id():
    tokenizer = build_traffic_tokenizer()
    short, long = tokenizer.encode_batch(["Is the light red?", "Is there a pedestrian on the crosswalk?"])
    assert len(short.ids) == len(long.ids)
    assert short.ids[-1] == tokenizer.token_to_id("[PAD]") and short.attention_mask[-1] == 0


def test_saved_as_tokenizer_json_and_reloaded(tmp_path):
    path = save_traffic_tokenizer(tmp_path)
    assert path.name == "tokenizer.json"
    reloaded = load_traffic_tokenizer(tmp_path)
    question = QUESTIONS["can_go"]
    assert reloaded.encode(question).ids == build_traffic_tokenizer().encode(question).ids
    assert reloaded.get_vocab() == build_traffic_tokenizer().get_vocab()
