"""The console of a training job, like a training tool's: one line per logged step and per evaluation, a closing
sentence, and none of Ray's report dicts, progress bars or start-up chatter unless run.verbose.

Ray Train calls its callbacks on the controller actor, whose prints reach the driver only with a
"(TrainController pid=...)" prefix and everything else Ray forwards; so the callback puts its lines on a Ray queue
and the driver prints them."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ray.data
import ray.train
from ray.util.queue import Empty, Queue
from transformers.utils import logging as transformers_logging

from pipelines.evaluate.common import duration  # shared with the evaluation job's progress line

QUIET_LOGGERS = ("mlflow", "ray", "ray.train", "ray.data", "DeepSpeed")


def quiet(verbose: bool) -> None:
    """The driver-side noise off: Ray Data's progress bars, checkpoint-writing bars, INFO chatter."""
    ray.data.DataContext.get_current().enable_progress_bars = verbose
    if verbose:
        return
    transformers_logging.disable_progress_bar()
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def step_line(metrics: dict[str, Any], max_steps: int, eta_s: float | None) -> str:
    """`step 50/6000  loss 2.314  lr 2.0e-03  1,234 tok/s  eta 9m12s`"""
    eta = f"  eta {duration(eta_s)}" if eta_s is not None else ""
    return (f"step {metrics['step']}/{max_steps}  loss {metrics['loss']:.3f}  lr {metrics['lr']:.1e}  "
            f"{metrics['tokens_per_s']:,.0f} tok/s{eta}")


def eval_line(metrics: dict[str, Any]) -> str | None:
    """`eval step 500  needle acc 0.93 (no memory 0.02)`, or the corpus' validation loss and token accuracy; None
    where the report holds no evaluation."""
    m, step = metrics, metrics.get("step")
    if "needle_accuracy" in m:
        return f"eval step {step}  needle acc {m['needle_accuracy']:.2f} (no memory {m['no_memory_accuracy']:.2f})"
    if "no_image_accuracy" in m:
        return (f"eval step {step}  held-out acc {m['accuracy']:.2f} (image withheld {m['no_image_accuracy']:.2f}, "
                f"majority {m['majority_accuracy']:.2f})  F1 {m['f1']:.2f}")
    if "val_loss" in m:
        return (f"eval step {step}  val loss {m['val_loss']:.3f} (no memory {m['no_memory_val_loss']:.3f})  "
                f"token acc {m['token_accuracy']:.2f} (no memory {m['no_memory_token_accuracy']:.2f})")
    return None


def mixture_line(metrics: dict[str, Any]) -> str:
    """`the mixture starts at step 2300`: where needle.base_until ended the base task's steps (`; the run ends at step
    7300`: needle.mixture_steps)."""
    ends = f"; the run ends at step {int(metrics['last_step'])}" if "last_step" in metrics else ""
    return f"the mixture starts at step {int(metrics['mixture_from'])}{ends}"


def closing_sentence(summary: dict[str, Any], tracking_uri: str | None) -> str:
    """What the model learned, where its export is, and how to look at the run."""
    if summary.get("error"):
        learned = f"The run failed: {summary['error']}."
    elif summary.get("needle_accuracy") is not None:
        learned = (f"The model answers {summary['needle_accuracy']:.0%} of held-out needle questions from its memory "
                   f"({summary['no_memory_accuracy']:.0%} without it).")
    elif summary.get("no_image_accuracy") is not None:
        learned = (f"The model answers {summary['accuracy']:.0%} of held-out scenes' questions from the image "
                   f"({summary['no_image_accuracy']:.0%} with it withheld; majority answer "
                   f"{summary['majority_accuracy']:.0%}).")
    elif summary.get("token_accuracy") is not None:
        learned = (f"The model predicts {summary['token_accuracy']:.0%} of held-out answer tokens with its memory "
                   f"({summary['no_memory_token_accuracy']:.0%} without it).")
    else:
        learned = f"The loss went from {summary.get('loss_first') or 0:.3f} to {summary.get('loss_last') or 0:.3f}."
    export = summary.get("export") or summary.get("encoder")
    where = f" The export is in {export}." if export else ""
    look = (f" Look at the run with: mlflow ui --backend-store-uri {tracking_uri}" if summary.get("mlflow_run_id")
            else "")
    return learned + where + look


class ConsoleCallback(ray.train.UserCallback):
    """On the controller: rank 0's reports as console lines, onto the driver's queue."""

    def __init__(self, queue: Queue, max_steps: int):
        self.queue, self.max_steps = queue, max_steps
        self.started: tuple[float, int] | None = None  # (time, step) of the first report, for the ETA
        self.mixture_said = False

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if not metrics or "step" not in metrics[0]:
            return
        m, now = metrics[0], time.monotonic()
        last = int(m.get("last_step", self.max_steps))  # where a recipe ends the run (TrainState.decay)
        if self.started is None or m["step"] <= self.started[1]:  # first report, or a restart from a checkpoint
            self.started = (now, m["step"])
            eta = None
        else:
            eta = (now - self.started[0]) / (m["step"] - self.started[1]) * (last - m["step"])
        self.queue.put(step_line(m, last, eta))
        if (line := eval_line(m)) is not None:
            self.queue.put(line)
        if "mixture_from" in m and not self.mixture_said:
            self.queue.put(mixture_line(m))
            self.mixture_said = True


class Console:
    """On the driver, around trainer.fit(): prints the callback's lines as they come."""

    def __init__(self, max_steps: int):
        self.queue = Queue(actor_options={"num_cpus": 0})
        self.callback = ConsoleCallback(self.queue, max_steps)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._print, daemon=True)

    def __enter__(self) -> "Console":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        ray.kill(self.queue.actor)

    def _print(self) -> None:
        while True:
            try:
                print(self.queue.get(timeout=0.5), flush=True)
            except Empty:
                if self.done.is_set():
                    return
