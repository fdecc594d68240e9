"""The registry and its pyfunc model without a sweep: an export saved directly, registered against a real
`mlflow server`, loaded by alias, answering text questions exactly as AwarenessModel.generate does. The pyfunc's
tokenizers and inputs without a registry: test_pyfunc.py."""

from __future__ import annotations

import os

import pytest
import torch

from pipelines.data.synthetic_needles import EOS, PROMPT_LEN, NeedleSpec, make_example
from pipelines.data.needle_tokenizer import needle_tokenizer
from pipelines.serving.register import register_run
from pipelines.tracking.registry import promote
from pipelines.serving.tiny import needle_questions, register_tiny_export

NAME = "awareness-registry-test"


@pytest.fixture(scope="module")
def registered(tmp_path_factory, checkpoint_root, mlflow_server):
    """A stage-like run holding an export/ with open gates (so the memory changes the answer), registered."""
    return register_tiny_export(tmp_path_factory.mktemp("registry"), checkpoint_root, mlflow_server.uri,
                                "registry-test", NAME, tags={"git.commit": "abc123",
                                                             "data.manifest_hash": "synthetic:x"})


def test_version_has_lineage_and_the_candidate_alias(registered, mlflow_server, checkpoint_root):
    from mlflow.tracking import MlflowClient

    _, version, run_id = registered
    found = MlflowClient(mlflow_server.uri).get_model_version_by_alias(NAME, "candidate")
    assert found.version == version.version and found.run_id == run_id
    assert found.tags["git.commit"] == "abc123" and found.tags["data.manifest_hash"] == "synthetic:x"
    assert found.tags["base.decoder"] == str(checkpoint_root / "tiny-qwen3") and found.tags["gca_layers"] == "2,3"
    promote(version.version, tracking_uri=mlflow_server.uri, name=NAME)
    assert MlflowClient(mlflow_server.uri).get_model_version_by_alias(NAME, "production").version == version.version


def test_pyfunc_answers_as_generate_does_and_reads_the_memory(registered, mlflow_server, monkeypatch):
    import mlflow

    model, _, _ = registered
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)  # not mlflow.set_tracking_uri: no global left behind
    pyfunc = mlflow.pyfunc.load_model(f"models:/{NAME}@candidate")
    tokenizer = needle_tokenizer()
    answers, expected = [], []
    for index in range(3):
        example = make_example(NeedleSpec(), seed=11, index=index)
        memory = [tokenizer.decode(chunk.tolist()) for chunk in example["memory"]]
        question = tokenizer.decode(example["input_ids"][0, 1:PROMPT_LEN].tolist())
        answers += pyfunc.predict({"question": question, "memory": memory})
        ids = torch.from_numpy(example["input_ids"][:1, :PROMPT_LEN])
        out = model.generate(ids, memory_input_ids=torch.from_numpy(example["memory"])[None],
                             max_new_tokens=4, do_sample=False, eos_token_id=EOS, pad_token_id=0)
        expected.append(tokenizer.decode(out[0, PROMPT_LEN:].tolist(), skip_special_tokens=True))
    assert answers == expected
    # The memory reaches the model as the very ids training used (a random model's greedy text barely depends on it).
    inputs = pyfunc.unwrap_python_model().encode(question, memory)
    assert torch.equal(inputs["memory_input_ids"][0], torch.from_numpy(example["memory"]))
    assert inputs["memory_attention_mask"].all()
    assert inputs["input_ids"].tolist() == example["input_ids"][:1, :PROMPT_LEN].tolist()


def test_registered_model_loads_without_this_repository(registered, mlflow_server, tmp_path, monkeypatch):
    """The model carries its code and states real requirements (not this package, which is not on PyPI): loaded in
    a fresh process where neither the repository nor its editable install is importable, it answers as here."""
    import json
    import os
    import subprocess
    import sys

    import mlflow

    from pipelines.tracking.registry import CODE_PATHS

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    local = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{NAME}@candidate", dst_path=str(tmp_path / "m"))
    requirements = open(os.path.join(local, "requirements.txt")).read()
    assert "awareness" not in requirements and "peft==" in requirements and "torch==" in requirements
    assert sorted(os.listdir(os.path.join(local, "code"))) == sorted(os.path.basename(p) for p in CODE_PATHS)
    example = make_example(NeedleSpec(), seed=11, index=0)
    tokenizer = needle_tokenizer()
    question = {"question": tokenizer.decode(example["input_ids"][0, 1:PROMPT_LEN].tolist()),
                "memory": [tokenizer.decode(chunk.tolist()) for chunk in example["memory"]]}
    script = (
        "import json, sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path\n"
        "                    if not getattr(f, '__module__', '').startswith('__editable__')]  # no editable install\n"
        "import mlflow\n"
        f"model = mlflow.pyfunc.load_model({local!r})\n"
        "import models, pipelines\n"
        f"print(json.dumps({{'answer': model.predict(json.loads({json.dumps(question)!r})),\n"
        "                  'code': [models.__file__, pipelines.__file__]}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(path.startswith(os.path.join(local, "code")) for path in result["code"])
    here = mlflow.pyfunc.load_model(local).predict(question)
    assert result["answer"] == here


def test_registering_a_run_without_an_export_says_so(mlflow_server):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server.uri)
    found = client.get_experiment_by_name("registry-test")
    run = client.create_run(found.experiment_id if found else client.create_experiment("registry-test"))
    with pytest.raises(FileNotFoundError, match="has no 'export' artifact"):
        register_run(run.info.run_id, tracking_uri=mlflow_server.uri, name=NAME)


def documented_registry_example() -> tuple[list[str], list[str], list[str]]:
    """The documented pyfunc example (docs/tracking.md): its memory (the example's own two lines, run), questions and
    commented answers."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "tracking.md").read_text()
    block = text[text.index('model = mlflow.pyfunc.load_model("models:/awareness@candidate")'):]
    block = block[: block.index("```")]
    scope: dict = {}
    exec("\n".join(line for line in block.splitlines() if line.startswith(("filler =", "memory =", "          "))),
         {}, scope)  # only the example's own two assignments
    call = re.search(r"model\.predict\((\[.*\])\)\s+# (\[.*\])", block)
    questions = re.findall(r'"question": "([^"]+)"', call.group(1))
    return scope["memory"], questions, eval(call.group(2))  # noqa: S307 - a literal list in our docs


def test_the_documented_example_asks_in_the_training_format():
    """Questions as stage 0 asks them (BOS key), a memory shaped like its memories (chunks of chunk_len ids the
    tokenizer knows, facts `key = d d d ;`), and the commented answers are the asked keys' values in that memory."""
    spec = NeedleSpec()
    tokenizer = needle_tokenizer()
    memory, questions, answers = documented_registry_example()
    assert len(memory) == spec.chunks and len(questions) == len(answers) >= 1
    ids = [tokenizer.encode(chunk, add_special_tokens=False).ids for chunk in memory]
    assert all(len(chunk) == spec.chunk_len for chunk in ids)
    assert not any(tokenizer.token_to_id("<unk>") in chunk for chunk in ids)
    for question, answer in zip(questions, answers, strict=True):
        assert len(tokenizer.encode(question).ids) == PROMPT_LEN  # BOS key, nothing after the key
        assert f"{question} = {answer} ;" in " ".join(memory)


def test_evaluate_scores_the_registered_version_through_its_pyfunc(registered, mlflow_server, tmp_path):
    """jobs/evaluate.py --model models:/NAME@ALIAS asks the pyfunc users are served (text in, text out): its
    answers to the needle probes are the model's own greedy answers."""
    from pipelines.data.memory_modes import MemoryMode
    from pipelines.evaluate.common import System, load_system, resolve_model
    from pipelines.evaluate.needle import answer_probe, make_probe, score_probe

    model, _, _ = registered
    tracking_env = os.environ.get("MLFLOW_TRACKING_URI")
    source = resolve_model(f"models:/{NAME}@candidate", mlflow_server.uri, tmp_path)
    assert source.registered and source.served and source.system["memory"] == "gca"
    served = load_system("gca", source.export, source.system, served=source.served, tracking_uri=mlflow_server.uri)
    direct = System("gca", model, MemoryMode(), NeedleSpec())
    known = set(needle_tokenizer().get_vocab().values())  # text can only carry ids the vocabulary names (this random
    for variant in ("single", "multi_value"):  # tiny decoder's 512 ids go past the needle vocabulary's 496)
        probe = make_probe(variant, NeedleSpec(), 1, seed=0, index=0)
        answers = answer_probe(served, probe)
        assert answers == [[t for t in a if t in known] for a in answer_probe(direct, probe)] and any(answers)
    rows = score_probe(served, "single", 1, seed=0, index=0)
    assert all(r["evidence_mass"] != r["evidence_mass"] for r in rows)  # NaN: a pyfunc does not show its attention
    assert os.environ.get("MLFLOW_TRACKING_URI") == tracking_env  # no global state left for later tests' processes


@pytest.mark.slow
def test_served_over_rest_answers_as_the_pyfunc(registered, mlflow_server, tmp_path, monkeypatch):
    """`mlflow models serve -m models:/NAME@candidate` (docs/tracking.md's command) answers needle questions over REST
    exactly as the pyfunc loaded in process does (the slow learning test scores a trained model over REST)."""
    import mlflow

    from pipelines.serving.loopback import ModelServer

    rows, _ = needle_questions(seed=5, memories=2)
    with ModelServer(f"models:/{NAME}@candidate", mlflow_server.uri, tmp_path) as server:
        served = server.predict(rows)
        limited = server.predict(rows[:1], params={"max_new_tokens": 1})
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    here = mlflow.pyfunc.load_model(f"models:/{NAME}@candidate").predict(rows)
    assert served == here and len(served) == len(rows)
    assert len(limited[0].split()) <= 1  # request params reach predict


def test_a_loader_places_a_registered_version_on_a_device_in_a_dtype(registered, mlflow_server, monkeypatch):
    """Every version logs the pyfunc's placement settings (device, dtype: "auto"), so a loader may override them:
    the Serve app's `dtype: bfloat16` (pipelines/serving/awareness-gpu.yaml), or MLFLOW_PYFUNC_INFERENCE_CONFIG for
    `mlflow models serve`. MLflow drops a model_config key a version was not logged with: without the logged keys
    this would load float32 silently."""
    import json

    import mlflow

    from pipelines.serving.app import load_pyfunc

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    uri = f"models:/{NAME}@candidate"
    assert load_pyfunc(uri).model.decoder.dtype == torch.float32  # the checkpoints' own, on this GPU-less machine
    placed = load_pyfunc(uri, dtype="bfloat16").model
    assert placed.device.type == "cpu" and {p.dtype for p in placed.parameters()} == {torch.bfloat16}
    monkeypatch.setenv("MLFLOW_PYFUNC_INFERENCE_CONFIG", json.dumps({"dtype": "bfloat16"}))
    assert mlflow.pyfunc.load_model(uri).unwrap_python_model().model.decoder.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="this process sees no GPU"):
        load_pyfunc(uri, device="cuda")
