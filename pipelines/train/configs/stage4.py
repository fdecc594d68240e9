"""Stage 4's config (jobs/stage4.py): a stage config (the pair, data and schedule of the GCA student) and its
distillation section: the teacher, its top-k and the loss's mixture."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from models.specs import CONFIG_NAME
from pipelines.data.memory_modes import read_system, system_mode
from pipelines.format.shards import MANIFEST
from pipelines.train.configs.stage import StageConfig

K_RANGE = (8, 256)  # top-k stored per target token; the range is 32-64 (k * 6 bytes a token)


@dataclass
class DistillConfig:
    """The student (the GCA pair) learns from a teacher that reads the same memory in its prompt."""

    teacher: str | None = None  # an export whose system.json reads the memory in its prompt (in_context or rag)
    teacher_steps: int = 0  # with no teacher: first train an in_context teacher on the same data for this many steps
    k: int = 32  # teacher top-k kept per target token (32-64: k * 6 bytes a token; pipelines.teachers.logits)
    alpha: float = 0.5  # loss = alpha * KL(teacher || student) over the top-k + (1 - alpha) * cross-entropy
    temperature: float = 1.0  # softens both sides of the KL (scaled by temperature^2)
    logits: str | None = None  # the teacher logits directory; None: CORPUS/teacher_logits, computed when absent or
    # written by another teacher, k or corpus. A directory named here must hold this teacher's logits (or none yet).
    actors: int = 1  # Ray Data actors scoring the corpus with the teacher
    use_gpu: bool = False  # one GPU per teacher actor
    baseline: bool = True  # also train the same student with alpha 0 on the same data and steps, to compare
    # The embedded default corpus (used when data.train_path is unset): one needle fact per memory, its value digits
    # copied into the target, each replaced by a random digit with probability label_noise.
    label_noise: float = 0.3
    train_rows: int = 4096  # rows of the embedded default corpus for training
    val_rows: int = 256  # and for validation

    def problems(self) -> list[str]:
        p = []
        if self.teacher:
            p += teacher_problems(self.teacher)
        elif self.teacher_steps <= 0:
            p.append("distill.teacher is missing: name a teacher export (--distill.teacher EXPORT, a stage run with "
                     "--model.memory in_context or rag), or train one first with --distill.teacher_steps N")
        if not K_RANGE[0] <= self.k <= K_RANGE[1]:
            p.append(f"distill.k must be within {K_RANGE[0]}-{K_RANGE[1]} (32-64 intended: k * 6 bytes per target "
                     f"token), got {self.k}")
        if not 0.0 <= self.alpha <= 1.0:
            p.append(f"distill.alpha must be within [0, 1] (the KL's weight), got {self.alpha}")
        if self.temperature <= 0:
            p.append(f"distill.temperature must be positive, got {self.temperature}")
        if self.actors <= 0:
            p.append("distill.actors must be positive")
        if not 0.0 <= self.label_noise < 1.0:
            p.append(f"distill.label_noise must be within [0, 1), got {self.label_noise}")
        if self.train_rows <= 0 or self.val_rows <= 0:
            p.append("distill.train_rows and distill.val_rows must be positive")
        if self.teacher and self.logits and not p:
            p += logits_problems(self.logits, self.teacher, self.k)
        return p


def teacher_problems(teacher: str) -> list[str]:
    if not (Path(teacher) / CONFIG_NAME).is_file():
        return [f"distill.teacher {teacher} is not an export (no {CONFIG_NAME}): pass the `export` path of a "
                f"finished stage run trained with --model.memory in_context (or rag)"]
    mode = system_mode(read_system(teacher))
    if not mode.in_prompt:
        return [f"distill.teacher {teacher} reads its memory as {mode.kind!r}; a teacher must read it in its prompt: "
                f"train it with --model.memory in_context (or rag)"]
    return []


def logits_problems(logits: str, teacher: str, k: int) -> list[str]:
    """Stored logits named explicitly must be this teacher's, at this k (the default directory is recomputed
    instead)."""
    manifest = Path(logits) / MANIFEST
    if not manifest.is_file():
        return []  # computed there
    stored = json.loads(manifest.read_text())
    problems = []
    from pipelines.teachers.logits import teacher_identity  # lazy: the model code, only where logits are stored

    if stored.get("teacher", {}).get("weights_sha256") != teacher_identity(teacher)["weights_sha256"]:
        other = stored.get("teacher", {}).get("export")
        problems.append(f"distill.logits {logits} holds the logits of another teacher ({other}), "
                        f"not of {teacher}: omit --distill.logits to compute this teacher's beside the corpus, or "
                        f"name an empty directory")
    if stored.get("k") != k:
        problems.append(f"distill.logits {logits} holds top-{stored.get('k')} logits, and distill.k is {k}: set "
                        f"--distill.k {stored.get('k')} or name another directory")
    return problems


@dataclass
class Stage4Config(StageConfig):
    """A stage config whose runs distil a teacher into the GCA student (pipelines.train.recipes.stage4)."""

    stage: int = 4
    distill: DistillConfig = field(default_factory=DistillConfig)

    def problems(self) -> list[str]:
        p = super().problems() + self.distill.problems()
        if self.model.memory != "gca":
            p.append(f"stage 4 trains a GCA student (model.memory gca) from a teacher reading its prompt; got "
                     f"model.memory {self.model.memory!r}")
        return p

    def stage_config(self, **changes) -> StageConfig:
        """The same pair, data and schedule as a plain stage config (without the distillation), e.g. its teacher's."""
        fields = {name: getattr(self, name) for name in StageConfig.__dataclass_fields__}
        return StageConfig(**(fields | changes))
