"""A 2-trial Ray Tune sweep on the tiny pair on 2 CPUs, against a real `mlflow server`: nested runs, the table and
plot on the parent, the best trial registered as `awareness@candidate`, which answers a needle question."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from models import AwarenessModel, MemoryReading
from pipelines.data.synthetic_needles import BOS, EOS, PROMPT_LEN, NeedleSpec, make_example

FAKE_TOKEN = "hf_FAKEsweepToken0123456789"
STEPS, EVAL_EVERY = 4, 2
NEEDLE = ["--needle.val_memories", "8", "--needle.facts", "4", "--needle.questions", "4"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, checkpoint_root, mlflow_server):
    """Runs the sweep job once for the module's tests. The tracking URI comes from $MLFLOW_TRACKING_URI and carries
    credentials, and a token sits in the environment the Ray workers inherit: neither may reach a run."""
    import ray

    from jobs.sweep import main

    tmp = tmp_path_factory.mktemp("sweep")
    patch = pytest.MonkeyPatch()
    uri_with_credentials = mlflow_server.uri.replace("http://", f"http://ci:{FAKE_TOKEN}@")
    patch.setenv("MLFLOW_TRACKING_URI", uri_with_credentials)
    patch.setenv("HF_TOKEN", FAKE_TOKEN)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    started = time.perf_counter()
    try:
        summary = main([
            "--model.pair", "tiny", "--stage", "0", "--sweep.num_samples", "2", "--sweep.lora_ranks", "8", "16",
            "--sweep.placements", "upper_half", "1,3", "--sweep.grace_period", "1", "--sweep.name", "tiny-sweep",
            "--sweep.fusions", "gca", "cross",
            "--train.max_steps", str(STEPS), "--train.eval_every", str(EVAL_EVERY), "--train.log_every", "2",
            "--train.checkpoint_every", str(STEPS), *NEEDLE, "--model.checkpoint_root", str(checkpoint_root),
            "--run.storage_path", str(tmp / "ray"),
        ])
    finally:
        ray.shutdown()  # only this test's local instance; never `ray stop`
        patch.undo()
    summary["test_wall_seconds"] = time.perf_counter() - started
    print(f"tiny sweep: {summary['test_wall_seconds']:.0f} s wall, {summary['max_concurrent_trials']} trials at once")
    return summary


@pytest.mark.ray
@pytest.mark.e2e
def test_two_trials_nest_under_the_sweep_run_with_table_and_plot(sweep, mlflow_server):
    from mlflow.tracking import MlflowClient

    assert sweep["trials"] == 2 and sweep["max_concurrent_trials"] == 2  # 2 x (0.1 + 0.9 CPU) on 2 CPUs
    client = MlflowClient(mlflow_server.uri)
    parent = client.get_run(sweep["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["sweep"] == "true"
    finished = [r for r in sweep["table"] if not r["stopped_early"]]
    assert finished and parent.data.metrics["trials_finished"] == len(finished)  # ASHA never stops the rung's first
    assert parent.data.metrics["sweep_wall_seconds"] > 0 and parent.data.metrics["sweep_cpu_seconds"] > 0
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "sweep")}
    assert {"sweep/table.md", "sweep/trials.json"} <= artifacts
    assert "sweep_rank_x_placement.png" in {a.path for a in client.list_artifacts(parent.info.run_id)}
    table = open(client.download_artifacts(parent.info.run_id, "sweep/table.md")).read()
    for row in sweep["table"]:
        assert row["error"] is None and row["needle_val_loss"] is not None
        assert f"| {row['fusion']} | {row['lora_rank']} | {row['placement']} |" in table
        child = client.get_run(row["mlflow_run_id"])
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.params["model.lora_rank"] == str(row["lora_rank"])
        assert child.data.params["model.gca_layers"] == row["placement"]
        assert child.data.params["model.fusion"] == row["fusion"]
        assert child.data.tags["data.manifest_hash"].startswith("synthetic:") and "git.commit" in child.data.tags
        evaluated = [m.step for m in client.get_metric_history(child.info.run_id, "needle_val_loss")]
        names = {a.path for a in client.list_artifacts(child.info.run_id)}
        if row["stopped_early"]:  # ASHA stopped it after an evaluation: its run says so, nothing is exported
            assert child.info.status == "KILLED" and child.data.tags["sweep.stopped_early"] == "true"
            # Tune stops a trial asynchronously: its workers may log one more evaluation before the stop arrives
            assert row["export"] is None and evaluated == list(range(EVAL_EVERY, evaluated[-1] + 1, EVAL_EVERY))
            assert row["steps"] <= evaluated[-1] <= row["steps"] + EVAL_EVERY
        else:
            assert child.info.status == "FINISHED" and row["steps"] == STEPS
            assert evaluated == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
            assert {"config.json", "export", "summary.json", "eval"} <= names


@pytest.mark.ray
@pytest.mark.e2e
def test_no_run_holds_the_planted_secret(sweep, mlflow_server):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server.uri)
    run_ids = [sweep["mlflow_run_id"], *(row["mlflow_run_id"] for row in sweep["table"])]
    for run_id in run_ids:
        run = client.get_run(run_id)
        assert FAKE_TOKEN not in json.dumps(run.data.params) + json.dumps(run.data.tags)
        config = open(client.download_artifacts(run_id, "config.json")).read()
        assert FAKE_TOKEN not in config
    assert "<redacted>@127.0.0.1" in client.get_run(run_ids[1]).data.params["tracking.tracking_uri"]


@pytest.mark.ray
@pytest.mark.e2e
def test_best_trial_is_registered_as_candidate_and_answers_a_needle_question(sweep, mlflow_server, monkeypatch):
    import mlflow
    from mlflow.tracking import MlflowClient
    from tokenizers import Tokenizer

    client = MlflowClient(mlflow_server.uri)
    best = sweep["best"]
    assert best["needle_val_loss"] == min(r["needle_val_loss"] for r in sweep["table"] if not r["stopped_early"])
    version = client.get_model_version_by_alias("awareness", "candidate")
    assert version.version == sweep["registered"]["version"] and version.run_id == best["mlflow_run_id"]
    assert version.tags["sweep_run_id"] == sweep["mlflow_run_id"]
    assert version.tags["data.manifest_hash"].startswith("synthetic:") and version.tags["git.commit"]
    assert version.tags["base.decoder"].endswith("tiny-qwen3")

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)  # not mlflow.set_tracking_uri: no global left behind
    pyfunc = mlflow.pyfunc.load_model("models:/awareness@candidate")
    tokenizer = Tokenizer.from_file(f"{version.tags['base.decoder']}/tokenizer.json")
    example = make_example(NeedleSpec(facts=4, questions=4), seed=1234 + 1, index=0)  # a held-out memory
    memory = [tokenizer.decode(chunk.tolist()) for chunk in example["memory"]]
    prompt = example["input_ids"][0, :PROMPT_LEN].tolist()  # BOS key
    question = tokenizer.decode(prompt[1:])
    assert tokenizer.encode(question).ids == prompt and prompt[0] == BOS and len(prompt) == 2
    assert [tokenizer.encode(text, add_special_tokens=False).ids for text in memory] == example["memory"].tolist()

    answer = pyfunc.predict({"question": question, "memory": memory})
    model = AwarenessModel.from_pretrained(best["export"]).eval()  # the trial's own export, straight from its run
    expected = model.generate(torch.tensor([prompt]), memory_input_ids=torch.from_numpy(example["memory"])[None],
                              memory_attention_mask=torch.ones(1, *example["memory"].shape, dtype=torch.long),
                              max_new_tokens=4, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    assert answer == [tokenizer.decode(expected[0, PROMPT_LEN:].tolist(), skip_special_tokens=True)]
    assert len(answer[0].split()) > 0


@pytest.mark.ray
@pytest.mark.e2e
def test_register_job_registers_any_run_and_promotes(sweep, mlflow_server, capsys):
    from mlflow.tracking import MlflowClient

    from jobs.register import main

    added = main(["--run_id", sweep["best"]["mlflow_run_id"], "--tracking_uri", mlflow_server.uri])  # any run
    client = MlflowClient(mlflow_server.uri)
    assert int(added["version"]) == int(sweep["registered"]["version"]) + 1
    assert client.get_model_version_by_alias("awareness", "candidate").version == added["version"]
    main(["--promote", sweep["registered"]["version"], "--tracking_uri", mlflow_server.uri])
    assert client.get_model_version_by_alias("awareness", "production").version == sweep["registered"]["version"]
    with pytest.raises(SystemExit) as exit:
        main(["--run_id", sweep["mlflow_run_id"], "--tracking_uri", mlflow_server.uri])  # the parent has none
    assert exit.value.code == 2 and "no 'export' artifact" in capsys.readouterr().err


def test_sweep_config_collects_every_problem():
    from pipelines.train.presets import sweep_base
    from pipelines.tune.sweep import SweepConfig

    base = sweep_base("tiny", 0)
    sweep = SweepConfig(num_samples=0, lora_ranks=[0], placements=["last:9"], lr_min=1e-2, lr_max=1e-3, trial_cpus=1,
                        fusions=["gca", "concat"])
    problems = "\n".join(sweep.problems(dataclasses_replace_decoder(base, "full")))
    for text in ("num_samples", "lora_ranks", "last:9", "lr_min", "trial_cpus", "model.decoder=lora", "concat"):
        assert text in problems, text
    assert SweepConfig().problems(base) == []
    # a decoder trained in full (a baseline's recipe): no rank to search unless asked for, and then a clear problem
    full = dataclasses_replace_decoder(base, "full")
    assert SweepConfig().problems(full) == [] and SweepConfig().lora_rank_choices(full) == [base.model.lora_rank]
    assert SweepConfig().lora_rank_choices(base) == [8, 16, 32, 64]
    assert "leave sweep.lora_ranks out" in "".join(SweepConfig(lora_ranks=[8]).problems(full))
    assert SweepConfig().placement_specs(base) == ["upper_third", "upper_half", "every_k:4", "last:4", "2,3"]
    assert SweepConfig().for_base(base).metric == "needle_val_loss"


def test_memory_top_k_is_a_choice_of_the_search_space():
    """sweep.memory_top_ks: each trial's model.memory_top_k; merged trials (they cannot route) read the whole memory."""
    from pipelines.train.presets import sweep_base
    from pipelines.tune.sweep import SweepConfig, trial_config

    base = sweep_base("tiny", 0)
    assert SweepConfig().memory_top_k_choices(base) == [0]
    assert SweepConfig(memory_top_ks=[0, 4]).memory_top_k_choices(base) == [0, 4]
    assert "sweep.memory_top_ks" in "\n".join(SweepConfig(memory_top_ks=[-1]).problems(base))
    params = {"lora_rank": 8, "gca_layers": "last:1", "lr": 1e-3, "memory_top_k": 4}
    assert trial_config(base, {**params, "fusion": "cross"}, "s", "t1").model.reading.top_k == 4
    assert trial_config(base, {**params, "fusion": "merged"}, "s", "t2").model.reading.top_k == 0
    # a base that routes with the lexical prior and router weights: the k = 0 trial reads without them, validly
    reading = MemoryReading(top_k=2, lexical_routing=1.0, lexical_reading=10.0, chunk_weights="router")
    lexical = dataclasses.replace(base, model=dataclasses.replace(base.model, reading=reading))
    unrouted = trial_config(lexical, {**params, "fusion": "gca", "memory_top_k": 0}, "s", "t3").model
    assert (unrouted.reading.top_k, unrouted.reading.lexical_routing, unrouted.reading.lexical_reading,
            unrouted.reading.chunk_weights) == (0, 0.0, None, "attention")
    routed = trial_config(lexical, {**params, "fusion": "gca"}, "s", "t4").model
    assert (routed.reading.top_k, routed.reading.lexical_routing, routed.reading.lexical_reading,
            routed.reading.chunk_weights) == (4, 1.0, 10.0, "router")


def test_stage_1_and_2_sweeps_start_from_their_jobs_defaults(tmp_path):
    from pipelines.train.presets import STAGE1, STAGE2
    from pipelines.train.presets import sweep_base
    from pipelines.tune.sweep import SweepConfig

    for stage, job in ((1, STAGE1), (2, STAGE2)):
        base = sweep_base(None, stage)
        assert base.stage == stage and base.model.pair == job.model.pair == "tiny-text" and base.model.decoder == "lora"
        assert base.train == job.train and base.data == job.data  # the job's schedule and data budget, not a copy
        assert (base.scaling.num_workers, base.scaling.cpus_per_worker) == (1, 0.4)
        assert "jobs/build_corpus.py --stage 2" in "\n".join(base.problems())  # no corpus given yet
    with pytest.raises(ValueError, match="512 token ids.*tiny-text"):
        sweep_base("tiny", 1)  # the needle vocabulary cannot hold a commit corpus's Qwen3 ids
    shards = tmp_path / "train"
    shards.mkdir()
    base = sweep_base(None, 1)
    with_train = dataclasses_replace_data(base, train_path=str(shards))
    assert SweepConfig().for_base(with_train).metric == "val_loss"
    assert "--data.val_path" in "\n".join(SweepConfig().problems(with_train))
    assert SweepConfig().problems(dataclasses_replace_data(base, train_path=str(shards), val_path=str(shards))) == []


def test_concurrency_counts_what_a_trial_reserves(monkeypatch, tmp_path):
    import ray

    from pipelines.train.presets import sweep_base
    from pipelines.tune.sweep import SweepConfig, max_concurrent_trials

    needles, corpus = sweep_base("tiny", 0), dataclasses_replace_data(sweep_base(None, 1), train_path=str(tmp_path))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    assert max_concurrent_trials(SweepConfig(), needles) == 2  # 2 / (0.1 + 0.9)
    assert max_concurrent_trials(SweepConfig(), corpus) == 4  # 2 / (0.1 + 0.4): workers read shards on their own CPUs
    with pytest.raises(ValueError, match="one trial needs 0.1 \\+ 4 x 0.5 CPUs"):
        max_concurrent_trials(SweepConfig(), dataclasses_replace_scaling(corpus, num_workers=4, cpus_per_worker=0.5))
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 8.0})
    assert max_concurrent_trials(SweepConfig(num_samples=20), corpus) == 16  # 8 / 0.5


def test_best_trial_is_the_best_that_ran_to_the_end():
    from pipelines.tune.sweep import SweepConfig, best_row
    from tests.pipelines.tune.test_report import ROWS

    best = best_row(ROWS, SweepConfig(metric="needle_val_loss"))
    assert best["trial_id"] == "a"  # b is lower but was stopped: nothing to register
    assert best_row(ROWS, SweepConfig(metric="needle_accuracy", mode="max"))["trial_id"] == "a"
    assert best_row([{**ROWS[0], "export": None}], SweepConfig(metric="needle_val_loss")) is None


def dataclasses_replace_decoder(base, decoder: str):
    import dataclasses

    return dataclasses.replace(base, model=dataclasses.replace(base.model, decoder=decoder))


def dataclasses_replace_data(base, **fields):
    import dataclasses

    return dataclasses.replace(base, data=dataclasses.replace(base.data, **fields))


def dataclasses_replace_scaling(base, **fields):
    import dataclasses

    return dataclasses.replace(base, scaling=dataclasses.replace(base.scaling, **fields))
