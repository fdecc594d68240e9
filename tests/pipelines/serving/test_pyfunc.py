"""The served pyfunc's own parts (pipelines/serving/pyfunc.py), without a registry: the tokenizers it writes for
random-weight checkpoints (the needle tokenizer itself: tests/pipelines/data/test_needle_tokenizer.py), how rows of
text become model inputs (gca right-pads the memory chunks; a baseline puts them in its prompt), the row formats it
accepts, and where an answer ends. Registered and served: test_register.py."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from models import AwarenessModel
from pipelines.data.memory_modes import GCA
from pipelines.data.needle_tokenizer import needle_tokenizer
from pipelines.data.synthetic_needles import EOS, PROMPT_LEN, NeedleSpec, make_example
from pipelines.format.tokenizer import text_tokenizer
from pipelines.serving.pyfunc import AwarenessPyfunc, _rows, ensure_tokenizer, signature
from pipelines.serving.tiny import needle_questions


def test_a_real_checkpoint_without_tokenizer_is_refused(tmp_path):
    (tmp_path / "Qwen3-0.6B").mkdir()
    with pytest.raises(FileNotFoundError, match="copy the checkpoint's tokenizer.json"):
        ensure_tokenizer(tmp_path / "Qwen3-0.6B")


def test_random_checkpoints_get_the_tokenizer_of_their_vocabulary(tmp_path):
    """tiny-text holds Qwen3's ids: the Qwen3 tokenizer (the corpora's, as tokenizer.json); the needle pairs the
    needle words."""
    from tokenizers import Tokenizer

    from models import PAIRS, write_random_checkpoints
    from pipelines.format.tokenizer import SPECIAL_IDS, VOCAB_SIZE, QwenTokenizer

    text_decoder, _ = write_random_checkpoints(PAIRS["tiny-text"], tmp_path)
    needle_decoder, _ = write_random_checkpoints(PAIRS["tiny"], tmp_path)
    qwen = Tokenizer.from_file(str(ensure_tokenizer(text_decoder)))
    assert qwen.get_vocab_size() == VOCAB_SIZE and qwen.token_to_id("<|im_end|>") == SPECIAL_IDS["<|im_end|>"]
    question = "Grow a.py to 9 functions\nFile: a.py\n"
    assert qwen.encode(question).ids == QwenTokenizer().encode_text(question)
    needle = Tokenizer.from_file(str(ensure_tokenizer(needle_decoder)))
    assert needle.encode("k117 = 4 0 7 ;").ids == [1, 117, 2, 14, 10, 17, 3]


@pytest.mark.parametrize("memory", ["in_context", "rag", "dense_rag", "none"])
def test_a_served_baseline_reads_its_memory_as_it_trained(tmp_path, checkpoint_root, memory):
    """A registered baseline's pyfunc puts the memory in the prompt (or drops it) exactly as training did, and answers
    with the model's greedy continuation of those ids; a memory store is refused (a baseline has no encoder to read).
    A dense_rag export reads with the retriever it carries, not the one its training named."""
    import shutil
    import types

    from models import AwarenessConfig, AwarenessModel, build_pair
    from models.retriever import DenseRetriever
    from pipelines.data.memory_modes import prompt_memory, read_system, system_mode
    from pipelines.serving.pyfunc import AwarenessPyfunc
    from tests.pipelines.evaluate.test_job import export_of

    extra = {}
    if memory == "dense_rag":
        retriever = DenseRetriever(build_pair("tiny", checkpoint_root=checkpoint_root).memory_encoder.encoder)
        retriever.save_pretrained(tmp_path / "r")
        extra = {"retriever": str(tmp_path / "r")}
    export = export_of(tmp_path, checkpoint_root, memory, **extra)
    shutil.rmtree(tmp_path / "r", ignore_errors=True)  # the export holds its own copy
    ensure_tokenizer(AwarenessConfig.load(export).decoder)
    served = AwarenessPyfunc()
    served.load_context(types.SimpleNamespace(artifacts={"export": str(export)},
                                              model_config={"max_new_tokens": 4, "eos_token": "<eos>"}))
    rows, _ = needle_questions(seed=3, memories=1)
    tokenizer = needle_tokenizer()
    example = make_example(NeedleSpec(), seed=3, index=0)
    question = example["input_ids"][0, :PROMPT_LEN].tolist()  # BOS key
    expected = prompt_memory(example["memory"].tolist(), question, system_mode(read_system(export))) + question
    inputs = served.encode(rows[0]["question"], rows[0]["memory"])
    assert inputs["input_ids"][0].tolist() == expected and "memory_input_ids" not in inputs
    assert len(expected) == {"in_context": NeedleSpec().chunks * NeedleSpec().chunk_len + 2,
                             "rag": 2 * NeedleSpec().chunk_len + 2, "dense_rag": 2 * NeedleSpec().chunk_len + 2,
                             "none": 2}[memory]
    model = AwarenessModel.from_pretrained(export).eval()
    out = model.generate(torch.tensor([expected]), max_new_tokens=4, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    answer = out[0, len(expected):].tolist()
    answer = answer[: answer.index(EOS)] if EOS in answer else answer
    assert served.predict(None, rows[:1]) == [tokenizer.decode(answer, skip_special_tokens=True)]
    with pytest.raises(ValueError, match="not through an encoder"):
        served.predict(None, [{"question": rows[0]["question"], "memory_store": str(tmp_path)}])


def needle_pyfunc(**settings) -> AwarenessPyfunc:
    """The pyfunc's text side as load_context sets it up for a gca needle export, without loading a model."""
    pyfunc = AwarenessPyfunc()
    pyfunc.tokenizer, pyfunc.text_tokenizer = needle_tokenizer(), text_tokenizer(needle_tokenizer())
    pyfunc.mode, pyfunc.pad_token_id = GCA, 0
    pyfunc.eos_token_id, pyfunc.skip_special_tokens = settings.get("eos", EOS), True
    return pyfunc


def test_gca_inputs_right_pad_each_chunk_and_mask_the_padding():
    inputs = needle_pyfunc().encode("k117", ["k117 = 4 0 7 ;", "w300 w301"])
    assert inputs["input_ids"].tolist() == [[1, 117]]  # <bos> key: the training prompt
    assert inputs["memory_input_ids"].tolist() == [[[117, 2, 14, 10, 17, 3], [300, 301, 0, 0, 0, 0]]]
    assert inputs["memory_attention_mask"].tolist() == [[[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0]]]
    bare = needle_pyfunc().encode("k117", [])  # no memory given: no memory tensors
    assert list(bare) == ["input_ids"] and torch.equal(bare["input_ids"], torch.tensor([[1, 117]]))


def test_an_answer_ends_at_the_first_end_token():
    assert needle_pyfunc().decode([14, 10, 17, EOS, 15]) == "4 0 7"
    assert needle_pyfunc(eos=[3, EOS]).decode([14, 3, 10]) == "4"  # a list of end tokens (generation_config's)
    assert needle_pyfunc().decode([14, 10]) == "4 0"  # cut at max_new_tokens: all of it


def test_rows_come_as_a_dataframe_a_dict_or_a_list():
    one = {"question": "k117", "memory": ["k117 = 4 0 7 ;"]}
    assert _rows(one) == [("k117", ["k117 = 4 0 7 ;"], None)]
    assert _rows([one, {"question": "k118", "memory_store": "/stores/repo"}]) == [
        ("k117", ["k117 = 4 0 7 ;"], None), ("k118", [], "/stores/repo")]
    frame = pd.DataFrame([one, {"question": "k119", "memory_store": "/s"}])  # a missing cell reads as NaN
    assert _rows(frame) == [("k117", ["k117 = 4 0 7 ;"], None), ("k119", [], "/s")]
    with pytest.raises(ValueError, match=r"needs a 'question'.*got \['memory'\]"):
        _rows({"memory": []})
    inputs = signature().inputs.to_dict()
    assert [c["name"] for c in inputs] == ["question", "memory", "memory_store"]
    assert [c.get("required", True) for c in inputs] == [True, False, False]


def test_the_serve_app_loads_an_export_directory_named_by_a_string(tmp_path, checkpoint_root):
    """pipelines/serving/awareness.yaml may name an export directory (a str from YAML): the app's loader takes it and
    answers with the pyfunc's defaults."""
    from pipelines.serving.app import load_pyfunc
    from pipelines.serving.tiny import tiny_export

    tiny_export(tmp_path / "export", checkpoint_root)
    pyfunc = load_pyfunc(str(tmp_path / "export"))
    rows, _ = needle_questions(seed=3, memories=1)
    assert pyfunc.mode.kind == "gca" and len(pyfunc.predict(None, rows[:1], {"max_new_tokens": 2})) == 1


def test_placement_names_the_device_and_dtype_and_refuses_what_cannot_be(monkeypatch):
    from pipelines.serving.pyfunc import placement

    assert placement() == (torch.device("cpu"), None)  # no GPU seen: the CPU, the checkpoints' dtype
    assert placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="dtype 'bf16': use auto .* or one of float32, bfloat16, float16"):
        placement("cpu", "bf16")
    with pytest.raises(ValueError, match="device 'tpu0': use auto, cpu, cuda or cuda:N"):
        placement("tpu0")
    with pytest.raises(ValueError, match="sees no GPU .*num_gpus: 1"):
        placement("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a replica with num_gpus: 1 sees
    assert placement("auto", "bfloat16") == (torch.device("cuda"), torch.bfloat16)


def test_an_export_served_in_bfloat16_answers_from_bfloat16_weights(tmp_path, checkpoint_root):
    """The app's loader places an export as asked: every weight (GCA blocks, loaded over the checkpoints) in bf16,
    and it answers."""
    from pipelines.serving.app import load_pyfunc
    from pipelines.serving.tiny import tiny_export

    tiny_export(tmp_path / "export", checkpoint_root)
    pyfunc = load_pyfunc(str(tmp_path / "export"), dtype="bfloat16")
    assert {p.dtype for p in pyfunc.model.parameters()} == {torch.bfloat16}
    rows, _ = needle_questions(seed=3, memories=1)
    assert len(pyfunc.predict(None, rows[:2], {"max_new_tokens": 2})) == 2


def test_predict_hands_generate_its_inputs_on_the_models_device(tmp_path, checkpoint_root, monkeypatch):
    """The question and the memory are tokenized on the CPU; a GPU-placed model needs them on its GPU (an H100 run
    of `predict` stopped at the encoder's embedding: "index is on cpu"). Here the model reports the meta device."""
    from pipelines.serving.app import load_pyfunc
    from pipelines.serving.tiny import tiny_export

    tiny_export(tmp_path / "export", checkpoint_root)
    pyfunc = load_pyfunc(str(tmp_path / "export"))
    seen = {}

    def generate(**inputs):
        seen.update({name: value.device for name, value in inputs.items() if isinstance(value, torch.Tensor)})
        return torch.zeros((1, inputs["input_ids"].shape[1] + 1), dtype=torch.long)

    monkeypatch.setattr(type(pyfunc.model), "device", property(lambda self: torch.device("meta")))
    monkeypatch.setattr(pyfunc.model, "generate", generate)
    rows, _ = needle_questions(seed=3, memories=1)
    pyfunc.predict(None, rows[:1], {"max_new_tokens": 1})
    assert seen.keys() >= {"input_ids", "memory_input_ids", "memory_attention_mask"}
    assert set(seen.values()) == {torch.device("meta")}


def test_an_export_served_with_a_4bit_base_answers_as_that_model_generates(tmp_path, checkpoint_root):
    """model_config quantize nf4: the pyfunc loads the export onto NF4 base linears (bitsandbytes' CPU backend here),
    the GCA blocks in full precision, and answers as the same quantized model's own generate does."""
    from models.quantization import is_quantized
    from pipelines.serving.tiny import tiny_export

    tiny_export(tmp_path / "export", checkpoint_root)
    ensure_tokenizer(AwarenessModel.from_pretrained(tmp_path / "export").config.decoder)
    pyfunc = AwarenessPyfunc()
    pyfunc.load_context(SimpleNamespace(artifacts={"export": str(tmp_path / "export")},
                                        model_config={"max_new_tokens": 4, "quantize": "nf4"}))
    assert is_quantized(pyfunc.model.decoder) and is_quantized(pyfunc.model.memory_encoder)
    assert all(p.dtype == torch.float32 for n, p in pyfunc.model.named_parameters() if "gca" in n)
    reference = AwarenessModel.from_pretrained(tmp_path / "export", quantize="nf4").eval()
    rows, _ = needle_questions(seed=3, memories=2)
    answers = pyfunc.predict(None, rows[:2])
    pyfunc.model = reference  # the same rows through a model loaded apart: the pyfunc adds nothing of its own
    assert pyfunc.predict(None, rows[:2]) == answers and all(isinstance(a, str) for a in answers)
    from pipelines.serving.app import load_pyfunc

    served = load_pyfunc(str(tmp_path / "export"), quantize="nf4")  # the Serve app's loader, its config's setting
    assert is_quantized(served.model.decoder) and served.predict(None, rows[:2], {"max_new_tokens": 4}) == answers
    with pytest.raises(ValueError, match="quantize must be one of"):
        load_pyfunc(str(tmp_path / "export"), quantize="4bit")
    with pytest.raises(ValueError, match="quantize must be one of"):
        AwarenessPyfunc().load_context(SimpleNamespace(artifacts={"export": str(tmp_path / "export")},
                                                       model_config={"quantize": "int4"}))

