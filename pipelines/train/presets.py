"""The stage jobs' embedded defaults: each `jobs/*.py` entry point runs its preset, overridden by `--config FILE` and
`--section.field VALUE`. Sweeps start from the same presets."""

from __future__ import annotations

import dataclasses

from models import PAIRS, MemoryReading, get_pair
from pipelines.data.ul2 import Ul2DataConfig
from pipelines.format.tokenizer import VOCAB_SIZE
from pipelines.train.configs.retriever import RetrieverConfig
from pipelines.train.configs.common import DeepSpeedSettings, RunSettings, ScalingSettings, TrainConfig
from pipelines.train.configs.stage import DataConfig, ModelConfig, NeedleConfig, StageConfig
from pipelines.train.configs.stage4 import DistillConfig, Stage4Config
from pipelines.train.configs.traffic import TrafficConfig
from pipelines.train.configs.ul2 import Ul2Config

# Stage 0 (`make demo`): a tiny random pair learns needle retrieval from scratch, so everything trains in full.
# Its encoder starts from its decoder (as Qwen3-Embedding starts from Qwen3), and attends bidirectionally, so a
# key's own state can carry the digits after it: the combination that learned fastest in our runs.
# ZeRO-2 here: the tiny pair fits anywhere, and ZeRO-3's per-layer parameter gathers cost it about twice the step
# time on CPU (measured side by side); every other job and test keeps ZeRO-3, the default of DeepSpeedSettings.
# About 12 minutes on 2 CPU cores (5,500 steps; docs/jobs.md).
STAGE0 = StageConfig(
    stage=0,
    # gca_gate_init: the random tiny pair has no pretrained behaviour for closed gates to protect, and a closed gate
    # is a saddle (gate and block get gradients only through each other): at 0, one of a seed's gates stayed shut
    # for 3,500+ steps and the run ended at chance; at 0.3 every seed tried learned (docs/jobs.md, stage 0).
    # Chunk routing: each query reads 2 of the memory's chunks, chosen by the learned router plus the question's
    # lexical prior and mixed by their scores, so a memory 64x the 4 chunks trained on is read as one of 4 is: full
    # attention fell to 0.16 on many similar facts at 64x, this holds 0.95 (docs/evaluation.md, "Lexical routing").
    # The prior at weight 3, not 1: at 1 the learned router outvoted it on 2x-4x memories (multi_value 0.60 at 4x,
    # 0.30 at 2x: the answer stopped after one value); at 3, 0.94 at 4x, the rest unchanged ("The prior's weight").
    # Read as trained: read at 10 (memory_lexical_reading) multi_value's 2x-8x dip goes, but a single answer no
    # longer ends, the value is given again (whole answers 0.98 -> 0.00 at 1x; "Reading weight").
    model=ModelConfig(pair="tiny-shared", gca_layers="upper_half", encoder_attention="bidirectional", decoder="full",
                      encoder="full", gca="full", gca_gate_init=0.3,
                      reading=MemoryReading(top_k=2, chunk_weights="router", lexical_routing=3.0)),
    # The RULER tasks the evaluation scores, once the lookup has formed on the base task (needle.base_steps: a
    # mixture from the first step never left the chance plateau): 2,000 steps of single questions (held-out 0.91 by
    # then), then 3,500 of the mixture, the two new answer formats weighted up, over memories of 1x-4x the base size
    # (memory_scale_max). Routing carries the read to 64x; the sizes teach the answer's length: trained at 1x alone,
    # from 4x a single value came twice (whole answers 0.00-0.02). 1x-4x holds 64x as 1x-8x did, at a cheaper step,
    # and this schedule in 5,500 steps as 3,000 + 4,000 did in 7,000: whole answers 0.94-0.99 at 1x-64x in 11.6 min
    # (docs/evaluation.md, "Training for size" and "A shorter preset").
    needle=NeedleConfig(variants=["single", "multi_key", "multi_value:3", "multi_query:3"], base_steps=2000,
                        memory_scale_max=4),
    train=TrainConfig(max_steps=5500, memories_per_step=16, lr=2e-3, warmup_steps=30, eval_every=500,
                      checkpoint_every=500, log_every=50),
    deepspeed=DeepSpeedSettings(zero_stage=2),
    run=RunSettings(name="stage0-tiny"),
)

# The tasks retrieval cannot match (`python jobs/beyond_lexical.py`; docs/jobs.md, "Questions retrieval cannot
# match"): stage 0's mixture plus alias, alias_multi_key and two_hop, each option below measured in that section.
# Each query reads 2 chunks, as stage 0's do: an alias answer names its key, so the decoder, not the blocks'
# attention, translates the alias, and each token also scores up the chunks holding it (the key an answer names is
# read next). Learned gates weigh the question's prior and the token's own, and in eval mode an answer token keeps its
# answer's last 4 tokens' priors at 0.75 of their weight. The mixture starts once the base task's lookup has formed
# (held-out 0.75), when that happens varies by seed, and runs 5,000 steps from there whenever that is, the rate
# decaying over them: how long the mixture trained, not the seed, had decided the RULER cells. The two answer formats
# slowest to learn weigh 5 each and the alias tasks, learned first, 3 between them, so a lookup that forms early
# still learns multi_query (docs/jobs.md says what a lighter share left). multi_value's answer gives its values
# sorted by their digits: the blocks read chunks apart, so which of two chunks comes first is not in what they read.
# ZeRO-0 and evaluations every 1,000 steps: 316k parameters need no partitioning, and ZeRO-2's fixed cost a step is
# time the model does not use.
BEYOND_LEXICAL = dataclasses.replace(
    STAGE0,
    model=dataclasses.replace(STAGE0.model, reading=dataclasses.replace(
        STAGE0.model.reading, lexical_gate=True, lexical_tokens=True, lexical_reading_window=4,
        lexical_window_carry=0.75)),
    needle=dataclasses.replace(
        STAGE0.needle, variants=["single", "multi_key", "multi_value:5", "multi_query:5", "alias:2",
                                 "alias_multi_key:1", "two_hop:4"], base_steps=4000, base_until=0.75,
        mixture_steps=5000, value_order="sorted"),
    train=dataclasses.replace(STAGE0.train, max_steps=9000, eval_every=1000, checkpoint_every=1000),
    deepspeed=DeepSpeedSettings(zero_stage=0),
    run=RunSettings(name="beyond-lexical"),
)

# Stage 1: the plan's schedule (GCA and projection alone for train.frozen_decoder_steps, then decoder LoRA too).
# tiny-text: the tiny shapes with Qwen3's vocabulary, so a laptop trains on real shards; pass --model.pair for more.
STAGE1 = StageConfig(
    stage=1,
    model=ModelConfig(pair="tiny-text", gca_layers="upper_third", decoder="lora", encoder="frozen", gca="full"),
    data=DataConfig(variants=["hinted", "imperative"], max_tokens=2048, max_chunks=16, chunk_len=512),
    train=TrainConfig(max_steps=1000, memories_per_step=8, lr=2e-4, warmup_steps=30, frozen_decoder_steps=100,
                      eval_every=200, checkpoint_every=200, log_every=20),
    scaling=ScalingSettings(cpus_per_worker=0.5),  # 2 workers and the driver on a 2-core laptop
    run=RunSettings(name="stage1"),
)

# Stage 2: every prompt variant of the commit shards, usually starting from stage 1's export.
# memories_per_step=16: the global batch must divide over the workers, and stage 2 is the job cluster.yaml runs on
# 2 nodes x 8 GPUs (16 workers, one example per GPU per step); 16 also divides the laptop's 2 workers and a sweep
# trial's 1. With 8, `--scaling.num_workers 16` was refused before it started.
STAGE2 = StageConfig(
    stage=2,
    model=ModelConfig(pair="tiny-text", gca_layers="upper_third", decoder="lora", encoder="frozen", gca="full"),
    data=DataConfig(variants=None, max_tokens=4096, max_chunks=32, chunk_len=512),
    train=TrainConfig(max_steps=2000, memories_per_step=16, lr=1e-4, warmup_steps=50, eval_every=250,
                      checkpoint_every=250, log_every=20),
    scaling=ScalingSettings(cpus_per_worker=0.5),  # 2 workers and the driver on a 2-core laptop
    run=RunSettings(name="stage2"),
)

# Stage 4 (`python jobs/stage4.py`): distillation on CPU. The default corpus is one needle fact per memory with noisy
# target digits (pipelines/train/recipes/stage4.py says why); an in_context teacher trains first (cached under the
# checkpoint root), then the GCA student with the teacher's top-32 (alpha 0.5), then the same student with alpha 0.
# The pair and settings are stage 0's, which learn a needle lookup from scratch on this machine.
STAGE4 = Stage4Config(
    model=ModelConfig(pair="tiny-shared", gca_layers="upper_half", encoder_attention="bidirectional", decoder="full",
                      encoder="full", gca="full", gca_gate_init=0.3, context_budget=64),
    needle=NeedleConfig(facts=1, questions=1, value_digits=4, chunk_len=7, distractors=0),
    data=DataConfig(max_tokens=64, max_chunks=8, chunk_len=8, val_examples=256),
    train=TrainConfig(max_steps=400, memories_per_step=64, lr=2e-3, warmup_steps=20, eval_every=200,
                      checkpoint_every=400, log_every=10),
    deepspeed=DeepSpeedSettings(zero_stage=2),
    distill=DistillConfig(teacher_steps=300, k=32, alpha=0.5),
    run=RunSettings(name="stage4-tiny", export_every_checkpoint=False),
)

# The UL2 job: a tiny random Qwen3 (the `tiny` pair's decoder) with a byte-level tokenizer, trained on
# this repository's own sources; everything trains in full. A few minutes on 2 CPU cores.
ENCODER_UL2 = Ul2Config(
    data=Ul2DataConfig(seq_len=128),
    train=TrainConfig(max_steps=200, memories_per_step=16, lr=2e-3, warmup_steps=10, log_every=10,
                      checkpoint_every=100),
    run=RunSettings(name="encoder-ul2-tiny", export_every_checkpoint=False),  # its export is the whole model
)

# The dense-rag baseline's retriever: the stage-0 pair's encoder trained contrastively on stage 0's needle mixture
# (pass the reader's --needle.* flags to match another), every chunk of a micro-batch a negative.
RETRIEVER = RetrieverConfig(
    needle=STAGE0.needle,
    train=TrainConfig(max_steps=1000, memories_per_step=16, lr=1e-3, warmup_steps=30, eval_every=250,
                      checkpoint_every=500, log_every=50),
)

STAGES = {0: STAGE0, 1: STAGE1, 2: STAGE2}  # the sweepable stages (stage 4 is a sequence of runs: jobs/stage4.py)

# The traffic-scene VLM (issue 15): a random SigLIP tower (224 px, patch 16: 196 vision tokens) and the seed's small
# cross-attention decoder, trained from scratch on rendered scenes with all six question types, every training row
# asking all six about its scene (data.pack_questions). ZeRO-2 as stage 0: the 18.7M-parameter model fits anywhere,
# and ZeRO-3's per-layer gathers only cost time on CPU. One worker with both cores: two one-core workers exchange
# 75 MB of gradients over gloo each step, which cost more than the second worker gained. Evaluated once, at the end
# (each evaluation reads the held-out scenes twice: with the image and without).
TRAFFIC_VLM = TrafficConfig(
    train=TrainConfig(max_steps=320, memories_per_step=16, lr=5e-4, warmup_steps=20, weight_decay=0.01,
                      log_every=10, eval_every=320, checkpoint_every=320),
    deepspeed=DeepSpeedSettings(zero_stage=2),
    scaling=ScalingSettings(num_workers=1, cpus_per_worker=2),
    run=RunSettings(name="traffic-vlm", export_every_checkpoint=False),  # its export is the whole model
)


# Sweeps (jobs/sweep.py) start from these: the stage's preset with the decoder in LoRA (its rank is swept), sized so
# several trials share a CPU machine; GPU clusters override scaling.*.
def sweep_base(pair: str | None, stage: int) -> StageConfig:
    """The trials' stage config before command-line overrides, the decoder in LoRA (its rank is swept). `pair`
    None: the stage's own default pair (tiny for stage 0, the stage job's for 1-2)."""
    if stage == 0:
        return stage0_sweep_base(pair or "tiny")
    if stage in (1, 2):
        return corpus_sweep_base(pair, stage)
    raise ValueError(f"--stage {stage}: stages are 0, 1 and 2")


def stage0_sweep_base(pair: str) -> StageConfig:
    """Stage 0: GCA in full; random pairs also train their encoder (it knows nothing). CPU-sized: one Train worker
    per trial on 0.9 CPU, so a 2-core machine runs two trials at once; GPU clusters override scaling.*."""
    random = PAIRS[pair].random_weights if pair in PAIRS else False
    return StageConfig(
        stage=0,
        model=ModelConfig(pair=pair, decoder="lora", encoder="full" if random else "frozen", gca="full",
                          encoder_attention="bidirectional" if random else None),
        train=TrainConfig(max_steps=400, memories_per_step=8, lr=1e-3, warmup_steps=20, log_every=50, eval_every=50,
                          checkpoint_every=400),
        scaling=ScalingSettings(num_workers=1, cpus_per_worker=0.9),
        run=RunSettings(name="sweep", max_failures=0, keep_checkpoints=1),
    )


def corpus_sweep_base(pair: str | None, stage: int) -> StageConfig:
    """Stages 1-2: the stage job's own preset (pipelines.train.presets, used by jobs/stage1.py or stage2.py: its
    schedule, data budget, variants, frozen-decoder warm-up), the decoder in LoRA. CPU-sized: one Train worker per
    trial on 0.4 CPU, so a trial reserves 0.5 with its own function, and on 2 cores up to four run at once. The corpus
    is the jobs' --data.train_path / --data.val_path (required)."""
    job = STAGES[stage]  # the job's preset is the one source of its defaults
    pair = pair or job.model.pair
    if vocab_problem(pair):
        raise ValueError(vocab_problem(pair))
    return dataclasses.replace(
        job,
        model=dataclasses.replace(job.model, pair=pair, decoder="lora"),
        scaling=dataclasses.replace(job.scaling, num_workers=1, cpus_per_worker=0.4),
        run=dataclasses.replace(job.run, name="sweep", max_failures=0, keep_checkpoints=1),
    )


def vocab_problem(pair: str) -> str | None:
    """Commit corpora hold Qwen3 token ids: a pair with a smaller vocabulary cannot read them."""
    vocab = get_pair(pair).decoder_config["vocab_size"]
    if vocab < VOCAB_SIZE:
        return (f"model.pair {pair}: its decoder has {vocab} token ids, but commit corpora hold Qwen3 token ids "
                f"(up to {VOCAB_SIZE - 1}): use tiny-text (the tiny shapes with Qwen3's vocabulary) or a real pair")
    return None
