"""The console's lines: one per logged step, one per evaluation, and the closing sentence."""

from __future__ import annotations

from pipelines.train.console import ConsoleCallback, closing_sentence, duration, eval_line, step_line


def test_step_line():
    metrics = {"step": 50, "loss": 2.31412, "lr": 0.002, "tokens_per_s": 1234.4}
    assert step_line(metrics, 6000, 552) == "step 50/6000  loss 2.314  lr 2.0e-03  1,234 tok/s  eta 9m12s"
    assert step_line(metrics, 6000, None) == "step 50/6000  loss 2.314  lr 2.0e-03  1,234 tok/s"
    assert duration(3 * 3600 + 125) == "3h02m"


def test_eval_lines_for_needles_and_corpora_and_none_otherwise():
    needles = {"step": 500, "needle_accuracy": 0.931, "no_memory_accuracy": 0.02}
    assert eval_line(needles) == "eval step 500  needle acc 0.93 (no memory 0.02)"
    corpus = {"step": 200, "val_loss": 1.5, "no_memory_val_loss": 2.25, "token_accuracy": 0.61,
              "no_memory_token_accuracy": 0.4}
    assert eval_line(corpus) == "eval step 200  val loss 1.500 (no memory 2.250)  token acc 0.61 (no memory 0.40)"
    traffic = {"step": 100, "accuracy": 0.914, "no_image_accuracy": 0.51, "majority_accuracy": 0.52, "f1": 0.9}
    assert eval_line(traffic) == "eval step 100  held-out acc 0.91 (image withheld 0.51, majority 0.52)  F1 0.90"
    assert eval_line({"step": 3, "loss": 1.0}) is None


def test_closing_sentence_says_what_was_learned_where_the_export_is_and_how_to_look():
    summary = {"needle_accuracy": 0.93, "no_memory_accuracy": 0.02, "export": "/runs/x/export",
               "mlflow_run_id": "abc", "error": None}
    sentence = closing_sentence(summary, "sqlite:///mlflow.db")
    assert "93% of held-out needle questions" in sentence and "(2% without it)" in sentence
    assert "/runs/x/export" in sentence and "mlflow ui --backend-store-uri sqlite:///mlflow.db" in sentence
    traffic = closing_sentence({"accuracy": 0.93, "no_image_accuracy": 0.5, "majority_accuracy": 0.52,
                                "export": "/t", "mlflow_run_id": None}, None)
    assert traffic == ("The model answers 93% of held-out scenes' questions from the image (50% with it withheld; "
                       "majority answer 52%). The export is in /t.")
    ul2 = closing_sentence({"loss_first": 5.7, "loss_last": 5.3, "encoder": "/e", "mlflow_run_id": None}, None)
    assert ul2 == "The loss went from 5.700 to 5.300. The export is in /e."


def test_the_start_of_the_mixture_is_said_once():
    """needle.base_until: every report after the switch carries mixture_from; the console says it the first time."""
    class Lines(list):
        put = list.append

    callback = ConsoleCallback(Lines(), 100)
    for step, extra in ((50, {}), (60, {"mixture_from": 55}), (70, {"mixture_from": 55})):
        callback.after_report(None, [{"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, **extra}], None)
    lines = callback.queue
    assert [line for line in lines if not line.startswith("step ")] == ["the mixture starts at step 55"]
    assert len(lines) == 4


def test_a_run_that_ends_after_its_mixture_counts_to_its_last_step():
    """needle.mixture_steps: once reports carry last_step, the step line and its ETA count to it, not max_steps."""
    class Lines(list):
        put = list.append

    callback = ConsoleCallback(Lines(), 9000)
    for step, extra in ((100, {}), (200, {"mixture_from": 150, "last_step": 5150})):
        callback.after_report(None, [{"step": step, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 10.0, **extra}], None)
    first, second, mixture = callback.queue
    assert first.startswith("step 100/9000  ") and second.startswith("step 200/5150  ")
    assert mixture == "the mixture starts at step 150; the run ends at step 5150"
