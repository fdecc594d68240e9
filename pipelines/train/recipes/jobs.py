"""The training jobs' entry sides (the Job protocol, pipelines.train.recipes): light to import, so a job's
--help, --dry-run and refusals answer in seconds; each imports its Recipe and the driver only to run."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch
from transformers import SiglipVisionConfig

from models.pairs import default_tiny_root, get_pair
from models.traffic_vlm import build_traffic_vlm, tiny_vision_config
from pipelines.format.shards import check_splits
from pipelines.train.configs.retriever import RetrieverConfig
from pipelines.train.configs.stage import StageConfig
from pipelines.train.configs.stage4 import Stage4Config
from pipelines.train.configs.traffic import TrafficConfig
from pipelines.train.configs.ul2 import Ul2Config
from pipelines.train.plan import plan_for_stage
from pipelines.train.recipes import Job, Recipe


class StageJob:
    """Stages 0-2: the corpus shards checked first, the memory plan in the dry run."""

    config = StageConfig

    def name(self, config: StageConfig) -> str:
        return f"stage{config.stage}"

    def check(self, config: StageConfig) -> dict[str, Any]:
        return check_shards(config) if config.data.train_path else {}

    def resolved(self, config: StageConfig) -> StageConfig:
        return stage_paths_resolved(config)

    def dry_run(self, config: StageConfig) -> list[str]:
        """The memory plan of its configured scaling, which a CPU run would have on as many GPUs."""
        device = "" if config.scaling.use_gpu else " (scaling.use_gpu is false: the same workers as GPUs)"
        lines = [f"# memory plan{device}", plan_for_stage(config).table()]
        if not config.scaling.use_gpu and config.deepspeed.zero_stage is None:
            lines.append("# CPU workers run ZeRO-3: the plan chooses the stage for GPU runs only")
        return lines

    def recipe(self) -> Recipe:
        from pipelines.train.recipes.stage import STAGE  # lazy: DeepSpeed, Ray Train: only to run

        return STAGE

    def run(self, config: StageConfig) -> dict[str, Any]:
        return run_once(self, config)


class Stage4Job(StageJob):
    """Stage 4, distillation: a stage job whose run is several (teacher, student, baseline) and whose paths include
    the teacher's."""

    config = Stage4Config

    def name(self, config: Stage4Config) -> str:
        return "stage4"

    def resolved(self, config: Stage4Config) -> Stage4Config:
        config = stage_paths_resolved(config)
        return dataclasses.replace(config, distill=absolute_paths(config.distill, ("teacher", "logits")))

    def recipe(self) -> Recipe:
        from pipelines.train.recipes.stage4 import DISTILLATION  # lazy: DeepSpeed, Ray Train: only to run

        return DISTILLATION

    def run(self, config: Stage4Config) -> dict[str, Any]:
        """The teacher's, student's and baseline's runs (pipelines.train.recipes.stage4)."""
        from pipelines.train.recipes.stage4 import run_stage4  # lazy: DeepSpeed, Ray Train: only to run

        return run_stage4(self, config)


class Ul2Job:
    """The UL2 encoder: no shards to check (its files are read by Ray Data), a model that fits whole on one device."""

    config = Ul2Config

    def name(self, config: Ul2Config) -> str:
        return "encoder_ul2"

    def check(self, config: Ul2Config) -> dict[str, Any]:
        return {}

    def resolved(self, config: Ul2Config) -> Ul2Config:
        return with_absolute_storage(config)

    def dry_run(self, config: Ul2Config) -> list[str]:
        return []

    def recipe(self) -> Recipe:
        from pipelines.train.recipes.ul2 import UL2  # lazy: DeepSpeed, Ray Train: only to run

        return UL2

    def run(self, config: Ul2Config) -> dict[str, Any]:
        return run_once(self, config)


class RetrieverJob:
    """The dense retriever: synthetic needles (nothing to check), an encoder that fits whole on one device."""

    config = RetrieverConfig

    def name(self, config: RetrieverConfig) -> str:
        return "retriever"

    def check(self, config: RetrieverConfig) -> dict[str, Any]:
        return {}

    def resolved(self, config: RetrieverConfig) -> RetrieverConfig:
        config = with_absolute_storage(config)
        return dataclasses.replace(config, model=absolute_paths(config.model, ("checkpoint_root",
                                                                               "encoder_checkpoint")))

    def dry_run(self, config: RetrieverConfig) -> list[str]:
        return []

    def recipe(self) -> Recipe:
        from pipelines.train.recipes.retriever import RETRIEVER  # lazy: DeepSpeed, Ray Train: only to run

        return RETRIEVER

    def run(self, config: RetrieverConfig) -> dict[str, Any]:
        return run_once(self, self.resolved(config))


class TrafficJob:
    """The traffic VLM: synthetic scenes (nothing to check), its model's shape in the dry run."""

    config = TrafficConfig

    def name(self, config: TrafficConfig) -> str:
        return "traffic_vlm"

    def check(self, config: TrafficConfig) -> dict[str, Any]:
        return {}

    def resolved(self, config: TrafficConfig) -> TrafficConfig:
        return with_absolute_storage(config)

    def dry_run(self, config: TrafficConfig) -> list[str]:
        return ["# model", traffic_model_lines(config)]

    def recipe(self) -> Recipe:
        from pipelines.train.recipes.traffic import TRAFFIC  # lazy: DeepSpeed, Ray Train: only to run

        return TRAFFIC

    def run(self, config: TrafficConfig) -> dict[str, Any]:
        return run_once(self, config)


JOBS: dict[type, Job] = {job.config: job for job in (StageJob(), Stage4Job(), Ul2Job(), TrafficJob(),
                                                     RetrieverJob())}


def job_for(config: Any) -> Job:
    """The job a typed config is the config of."""
    return JOBS[type(config)]


def train(config: Any) -> dict[str, Any]:
    """Trains the job a typed config is the config of (stage 4: its teacher, student and baseline runs), without the
    entry point's checks and printing (pipelines.train.job.run_job); its summary."""
    return job_for(config).run(config)


def run_once(job: Job, config: Any) -> dict[str, Any]:
    from pipelines.train.driver import run_training_job  # lazy: Ray Train and DeepSpeed, only to run

    return run_training_job(job, config)


def absolute_paths(section: Any, names: tuple[str, ...]) -> Any:
    """`section` with its fields `names` made absolute where they are set and local (a URL stays as given)."""
    return dataclasses.replace(section, **{name: str(Path(getattr(section, name)).expanduser().resolve())
                                           for name in names
                                           if getattr(section, name) and "://" not in getattr(section, name)})


def with_absolute_storage(config: Any) -> Any:
    run = dataclasses.replace(config.run, storage_path=str(Path(config.run.storage_path).expanduser().resolve()))
    return dataclasses.replace(config, run=run)


def check_shards(config: StageConfig) -> dict[str, Any]:
    """Every shard the stage will read, against the corpus manifest: present, its size, no foreign file, and its
    sha256 with data.verify_hashes (about 1 CPU-second per GiB, 8 files at a time)."""
    d, started = config.data, time.perf_counter()
    splits = check_splits([d.train_path, d.val_path], hashes=d.verify_hashes)
    return {"shards": sum(len(s.shards) for s in splits), "hashed": d.verify_hashes,
            "seconds": round(time.perf_counter() - started, 2)}


def traffic_model_lines(config: TrafficConfig) -> str:
    """The traffic VLM's shape, built on the meta device (no memory, no weights read): vision tokens and parameters."""
    m = config.model
    vision = (SiglipVisionConfig.from_pretrained(m.vision_path) if m.vision_path else
              tiny_vision_config(image_size=m.image_size, patch_size=m.patch_size, hidden_size=m.vision_hidden_size,
                                 layers=m.vision_layers, heads=m.vision_heads))
    with torch.device("meta"):
        model = build_traffic_vlm(yes_id=4, no_id=5, vision_config=vision, vocab_size=m.vocab_size,
                                  hidden_size=m.hidden_size, intermediate_size=m.intermediate_size, layers=m.layers,
                                  heads=m.heads, kv_heads=m.kv_heads, max_positions=m.max_positions)
    counts = {part: sum(p.numel() for p in getattr(model, part).parameters()) for part in ("vision", "decoder")}
    tokens = (vision.image_size // vision.patch_size) ** 2
    return (f"vision tokens: {tokens} ({vision.image_size}/{vision.patch_size} squared, width {vision.hidden_size}); "
            f"parameters: vision {counts['vision'] / 1e6:.2f}M, decoder {counts['decoder'] / 1e6:.2f}M "
            f"(vocab {m.vocab_size}, hidden {m.hidden_size}, {m.layers} layers, {m.heads} q / {m.kv_heads} kv heads)")


def stage_paths_resolved(config: StageConfig) -> StageConfig:
    """The storage path, a random pair's checkpoint root (written only when the job runs) and every local path the
    workers read (data, init_from, encoder_checkpoint, retriever) made absolute: a worker
    does not start in the driver's directory. The dry run shows them; the run's driver uses them."""
    config = with_absolute_storage(config)
    model, data = config.model, config.data
    if get_pair(model.pair).random_weights:
        root = Path(model.checkpoint_root or default_tiny_root()).expanduser().resolve()
        model = dataclasses.replace(model, checkpoint_root=str(root))
    return dataclasses.replace(config, model=absolute_paths(model, ("init_from", "encoder_checkpoint", "retriever")),
                               data=absolute_paths(data, ("train_path", "val_path")))
