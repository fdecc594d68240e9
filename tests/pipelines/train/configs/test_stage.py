import importlib.util
import json
import sys
from pathlib import Path

import pytest

from pipelines.cli import parse_config, schema
from pipelines.evaluate.job import EvaluateConfig
from pipelines.train.configs.common import TrainConfig
from pipelines.train.configs.stage import ModelConfig, StageConfig
from pipelines.train.configs.traffic import TrafficConfig
from pipelines.train.configs.ul2 import Ul2Config
from pipelines.tune.sweep import SweepJob

ROOT = Path(__file__).resolve().parents[4]
DEFAULT = StageConfig(model=ModelConfig(pair="tiny"), train=TrainConfig(max_steps=10))


def test_file_then_flags_override_the_default(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  max_steps: 50\n  lr: 0.01\nmodel:\n  gca_layers: last:2\n")
    config = parse_config(["--config", str(path), "--train.lr", "3e-4", "--tracking.tracking_uri", "none",
                           "--deepspeed.offload_optimizer", "true"], DEFAULT)
    assert config.train.max_steps == 50 and config.train.lr == 3e-4 and config.model.gca_layers == "last:2"
    assert config.deepspeed.offload_optimizer is True and config.tracking.tracking_uri is None
    assert StageConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_every_problem_is_reported_at_once():
    config = StageConfig(model=ModelConfig(pair="tiny", gca_layers="last:9", decoder="half", lora_targets=["qkv"]),
                         train=TrainConfig(max_steps=0, memories_per_step=15))
    with pytest.raises(ValueError) as error:
        config.validate()
    message = str(error.value)
    for expected in ("model.gca_layers", "outside the decoder's 4 layers", "model.decoder must be one of",
                     "model.lora_targets has unknown names ['qkv']", "train.max_steps must be positive",
                     "train.memories_per_step (15) must divide evenly over scaling.num_workers (2)"):
        assert expected in message


def test_needle_settings_out_of_range_stop_with_one_line(capsys):
    for flags, expected in ((["--needle.base_until", "90"], "needle.base_until must be an accuracy in [0, 1], got 90"),
                            (["--needle.base_steps", "0", "--needle.base_until", "0.9"],
                             "give the most with --needle.base_steps"),
                            (["--needle.base_check_every", "0"], "needle.base_check_every must be >= 1, got 0"),
                            (["--needle.mixture_steps", "500"], "base_until is off: give it too"),
                            (["--needle.mixture_steps", "-1"], "needle.mixture_steps must be >= 0, got -1"),
                            (["--needle.base_steps", "400", "--needle.base_until", "0.9", "--needle.mixture_steps",
                              "800", "--train.max_steps", "1000"], "use --train.max_steps 1200"),
                            (["--needle.value_order", "shuffled"],
                             "needle: needle.value_order must be one of ('memory', 'sorted'), got 'shuffled'"),
                            (["--needle.one_value_share", "1"],
                             "needle.one_value_share (1.0) is the share of a multi_value memory's asked keys")):
        with pytest.raises(SystemExit) as stop:
            parse_config(flags, DEFAULT)
        assert stop.value.code == 2 and expected in capsys.readouterr().err
    assert parse_config(["--needle.base_steps", "10", "--needle.base_until", "0.9"], DEFAULT).needle.base_until == 0.9


def test_unknown_keys_and_wrong_types_are_named(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  max_step: 5\n")
    for argv, expected in ((["--config", str(path)],
                            "unknown config key 'train.max_step'; did you mean --train.max_steps?"),
                           (["--train.max_steps", "many"], "train.max_steps expects int, got 'many'"),
                           (["--train.nope", "1"], "unknown config key 'train.nope'")):
        with pytest.raises(SystemExit) as exit:
            parse_config(argv, DEFAULT)
        assert exit.value.code == 2
        assert expected in capsys.readouterr().err


def test_data_and_start_points_that_do_not_exist_are_named(tmp_path):
    from pipelines.train.configs.stage import DataConfig

    config = StageConfig(stage=1, model=ModelConfig(encoder_checkpoint=str(tmp_path / "no-encoder"),
                                                    init_from=str(tmp_path / "no-export")),
                         data=DataConfig(train_path=str(tmp_path / "missing" / "train"), max_chunks=0))
    message = "\n".join(config.problems())
    for expected in ("model.encoder_checkpoint", "export/encoder", "model.init_from", "awareness.safetensors",
                     "data.train_path", "jobs/build_corpus.py", "data.max_chunks must be positive"):
        assert expected in message, expected
    stage2 = "\n".join(StageConfig(stage=2).problems())
    assert "stage 2 trains on commit shards" in stage2 and "--data.train_path" in stage2


def test_expert_lora_is_a_flag_for_moe_pairs_only(capsys):
    flags = ["--model.lora_targets", "q_proj", "k_proj", "v_proj", "o_proj", "experts"]
    config = parse_config(["--model.pair", "tiny-moe", *flags], DEFAULT)
    assert config.model.lora_targets[-1] == "experts"
    with pytest.raises(SystemExit):
        parse_config(flags, DEFAULT)
    assert "'experts' is LoRA on Qwen3-MoE experts, and pair 'tiny' is dense" in capsys.readouterr().err


def test_gate_init_opens_the_gates_before_training_and_an_export_overrides_it(tmp_path):
    """stage 0's random default starts with open gates (a closed gate is a saddle); a loaded export's gates win."""
    import math

    from pipelines.train.model import build_model

    closed = build_model(ModelConfig(pair="tiny"))
    assert set(closed.gate_values().values()) == {0.0}
    opened = build_model(ModelConfig(pair="tiny", gca_gate_init=0.3))
    assert all(abs(v - math.tanh(0.3)) < 1e-6 for v in opened.gate_values().values())
    closed.save_pretrained(tmp_path / "export")
    loaded = build_model(ModelConfig(pair="tiny", gca_gate_init=0.3, init_from=str(tmp_path / "export")))
    assert set(loaded.gate_values().values()) == {0.0}


def test_fusion_is_validated_with_the_reason(capsys):
    """An unknown fusion, and combinations that cannot mean anything, are one line each on stderr and exit 2."""
    def problems(*flags):
        with pytest.raises(SystemExit) as stop:
            parse_config(list(flags), DEFAULT)
        assert stop.value.code == 2
        return capsys.readouterr().err

    assert ("model.fusion must be one of ('gca', 'cross', 'merged'), got 'concat'"
            in problems("--model.fusion", "concat"))
    err = problems("--model.fusion", "cross", "--model.memory", "rag", "--model.gca_mlp", "true")
    assert "model.memory rag is a baseline" in err and "model.gca_mlp adds gated MLPs" in err
    err = problems("--model.fusion", "merged", "--model.decoder", "frozen", "--model.gca", "lora")
    assert "train the decoder with model.decoder lora or full" in err and "model.fusion merged has none" in err
    for fusion in ("cross", "merged"):
        assert parse_config(["--model.fusion", fusion], DEFAULT).model.fusion == fusion


@pytest.mark.parametrize("config", [StageConfig, Ul2Config, TrafficConfig, SweepJob, EvaluateConfig],
                         ids=lambda c: c.__name__)
def test_every_field_of_every_job_config_says_what_it_does_in_help(config):
    """`--help` prints each field's `# comment`: a field without one shows only its default."""
    undocumented = [key for key, (_, doc, _) in schema(config).items() if not doc]
    assert not undocumented, f"{config.__name__}: give these fields a trailing # comment: {undocumented}"



@pytest.mark.parametrize("job, config", [("build_corpus", "BuildJob"), ("curriculum", "CurriculumConfig"),
                                         ("encode_memory", "EncodeMemoryConfig"), ("generate", "GenerateArgs"),
                                         ("plan", "PlanInput"), ("register", "RegisterArgs"),
                                         ("stage3_data", "Stage3Job")])
def test_every_other_job_says_what_each_flag_does(job, config, monkeypatch):
    spec = importlib.util.spec_from_file_location(f"job_{job}", ROOT / "jobs" / f"{job}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    undocumented = [key for key, (_, doc, _) in schema(getattr(module, config)).items() if not doc]
    assert not undocumented, f"jobs/{job}.py: give these fields a trailing # comment: {undocumented}"


def test_needle_size_and_mixture_flags_parse_and_are_validated(capsys):
    """The issue-26 needle fields: parsed from flags into the spec, each bad value one line naming the fix, and an
    in_context row that would ask every fact refused (its last answer would follow by elimination)."""
    config = parse_config(["--needle.memory_scale_max", "8", "--needle.hard_distractors", "0.5", "--needle.key_tokens",
                           "2", "--needle.variants", "single:4", "multi_key:2", "multi_value", "--needle.hops", "2"],
                          DEFAULT)
    spec = config.needle.spec()
    assert (spec.memory_scale_max, spec.hard_distractors, spec.key_tokens, spec.hops) == (8, 0.5, 2, (2,))
    assert spec.mixture() == {"single": 4.0, "multi_key": 2.0, "multi_value": 1.0}
    for flags, expected in ((["--needle.memory_scale_max", "0"], "needle.memory_scale_max (0) must be >= 1"),
                            (["--needle.hard_distractors", "1.5"], "within [0, 1]"),
                            (["--needle.key_tokens", "3"], "needle.key_tokens must be 1 or 2"),
                            (["--needle.variants", "single", "bogus"], "'bogus' is not one of"),
                            (["--needle.variants", "single:0"], "needs a positive weight"),
                            (["--needle.hops", "1"], "give chain lengths >= 2"),
                            (["--needle.questions_per_row", "0"], "needle.questions_per_row must be >= 1"),
                            (["--model.memory", "in_context", "--needle.questions_per_row", "8"],
                             "follows by elimination: use --needle.questions_per_row 4")):
        with pytest.raises(SystemExit) as stop:
            parse_config(flags, DEFAULT)
        assert stop.value.code == 2
        assert expected in capsys.readouterr().err, flags
    # gca: no row shares
    assert parse_config(["--needle.questions_per_row", "8"], DEFAULT).needle.questions_per_row == 8


def test_memory_routing_flags_are_validated_and_reach_the_model_and_its_export(capsys, tmp_path):
    """--model.memory_top_k / memory_logn_scale / memory_routing_loss: documented in --help, refused where they cannot
    apply, built into the model and written into its export's config."""
    from models import AwarenessModel
    from pipelines.train.model import build_model

    with pytest.raises(SystemExit):
        parse_config(["--help"], DEFAULT)
    shown = " ".join(capsys.readouterr().out.split())
    for flag, doc in (("--model.memory_top_k", "0: the whole memory"), ("--model.memory_logn_scale", "0: off"),
                      ("--model.memory_routing_loss", "the routers do not learn")):
        assert flag in shown and doc in shown
    with pytest.raises(SystemExit):
        parse_config(["--model.fusion", "merged", "--model.decoder", "full", "--model.memory_top_k", "4",
                      "--model.memory_logn_scale", "1", "--model.memory_routing_loss", "-1"], DEFAULT)
    err = capsys.readouterr().err
    for expected in ("model.memory_logn_scale must be 0 (off)", "model.memory_routing_loss must be >= 0"):
        assert expected in err
    # a baseline reads its memory in the prompt, merged in the decoder's own softmax: a preset's routing does not
    # reach their models
    for system in (["--model.memory", "rag"], ["--model.fusion", "merged", "--model.decoder", "full"]):
        unrouted = build_model(parse_config([*system, "--model.memory_top_k", "4", "--model.memory_lexical_routing",
                                             "1", "--model.memory_chunk_weights", "router"], DEFAULT).model)
        assert (unrouted.reading.top_k, unrouted.reading.lexical_routing, unrouted.reading.chunk_weights) == (
            0, 0.0, "attention")
    assert all(block.router is None for block in unrouted.memory_readers().values() if hasattr(block, "router"))
    config = parse_config(["--model.memory_top_k", "2", "--model.memory_logn_scale", "512"], DEFAULT)
    model = build_model(config.model)
    assert (model.reading.top_k, model.reading.logn_scale) == (2, 512) and model.gca_blocks()[3].router is not None
    loaded = AwarenessModel.from_pretrained(model.save_pretrained(tmp_path / "export"))
    assert (loaded.reading.top_k, loaded.reading.logn_scale, loaded.reading.routing_loss) == (2, 512, 1.0)
    for flags, expected in ((["--model.memory_routing_grad", "true"], "set model.memory_top_k too"),
                            (["--model.memory_top_k", "2", "--model.memory_summaries", "0"],
                             "model.memory_summaries must be >= 1"),
                            (["--model.memory_chunk_weights", "router"], "set model.memory_top_k (e.g. 2)"),
                            (["--model.memory_top_k", "2", "--model.memory_chunk_weights", "tokens"],
                             "model.memory_chunk_weights must be one of attention, router"),
                            (["--model.memory_lexical_routing", "1"], "model.memory_top_k > 0 with a positive one"),
                            (["--model.memory_top_k", "2", "--model.memory_lexical_routing", "-1"],
                             "give a weight >= 0"),
                            (["--model.memory_top_k", "2", "--model.memory_lexical_reading", "10"],
                             "with a positive model.memory_lexical_routing"),
                            (["--model.memory_top_k", "2", "--model.memory_lexical_routing", "3",
                              "--model.memory_lexical_reading", "-1"], "model.memory_lexical_reading (-1.0)")):
        with pytest.raises(SystemExit):
            parse_config(flags, DEFAULT)
        assert expected in capsys.readouterr().err
    config = parse_config(["--model.memory_top_k", "2", "--model.memory_summaries", "4", "--model.memory_routing_grad",
                           "true"], DEFAULT)
    model = build_model(config.model)
    assert (model.reading.summaries, model.routing_trains_summaries) == (4, True)
    loaded = AwarenessModel.from_pretrained(model.save_pretrained(tmp_path / "summaries"))
    assert (loaded.reading.summaries, loaded.routing_trains_summaries) == (4, False)  # a training choice: not saved
    config = parse_config(["--model.memory_top_k", "2", "--model.memory_chunk_weights", "router"], DEFAULT)
    loaded = AwarenessModel.from_pretrained(build_model(config.model).save_pretrained(tmp_path / "router"))
    assert loaded.reading.chunk_weights == "router"
    config = parse_config(["--model.memory_top_k", "2", "--model.memory_lexical_routing", "1.5"], DEFAULT)
    loaded = AwarenessModel.from_pretrained(build_model(config.model).save_pretrained(tmp_path / "lexical"))
    assert (loaded.reading.lexical_routing, loaded.reading.lexical_reading) == (1.5, None)
    config = parse_config(["--model.memory_top_k", "2", "--model.memory_lexical_routing", "3",
                           "--model.memory_lexical_reading", "10"], DEFAULT)
    loaded = AwarenessModel.from_pretrained(build_model(config.model).save_pretrained(tmp_path / "reading"))
    assert (loaded.reading.lexical_routing, loaded.reading.lexical_reading) == (3.0, 10.0)


@pytest.mark.parametrize("uri", ["file:///tmp/mlruns", "/tmp/mlruns", "./mlruns"])
def test_a_file_store_tracking_uri_is_refused_before_the_run(uri, capsys, monkeypatch):
    """MLflow 3 refuses its file store with a traceback from the driver's first call; the job says it in one line."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(SystemExit):
        parse_config(["--tracking.tracking_uri", uri], DEFAULT)
    assert "is MLflow's file store" in capsys.readouterr().err
    for fine in (["--tracking.tracking_uri", "sqlite:///tmp/mlflow.db"], ["--tracking.tracking_uri", uri,
                                                                            "--tracking.enabled", "false"]):
        parse_config(fine, DEFAULT)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    parse_config(["--tracking.tracking_uri", uri], DEFAULT)
