"""The training step's levers against eager on the device, the same random weights (the `small` pair in bf16, gates
opened, the pipeline's training configuration): regional torch.compile (inductor's generated kernels), Liger-Kernel's
RMSNorm, SwiGLU and RoPE, and the loss without full logits (Liger's fused linear cross-entropy) against transformers'
loss on full logits.

Tolerances (bf16): the loss within 2e-2 nats; the trained parameters' gradients within 5e-2 relative error
(||got - eager|| / ||eager|| over all of them). Liger patches transformers' classes for the rest of a process, so its
comparison runs in a child process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import build_pair
from pipelines.train.configs.stage import ModelConfig
from pipelines.train.model import prepare_model
from tests.gpu.conftest import relative_error

pytestmark = pytest.mark.gpu

LOSS_TOLERANCE, GRAD_TOLERANCE = 2e-2, 5e-2
ROOT = Path(__file__).resolve().parents[2]


def step(device, *, compiled: bool = False) -> tuple[float, torch.Tensor]:
    """One training step's loss and its trainable gradients, flattened."""
    torch.manual_seed(0)
    model = build_pair("small", random_init=True, device=device, dtype=torch.bfloat16)
    model = prepare_model(model, ModelConfig(pair="small")).train()
    model.set_gates(0.5)
    if compiled:
        model.compile_layers()
    g = torch.Generator().manual_seed(3)
    batch = {"input_ids": torch.randint(3, 490, (2, 64), generator=g).to(device),
             "memory_input_ids": torch.randint(3, 490, (2, 4, 64), generator=g).to(device)}
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.requires_grad])
    return float(loss), grads


def test_compiled_layers_match_eager(device):
    eager_loss, eager_grads = step(device)
    loss, grads = step(device, compiled=True)
    assert abs(loss - eager_loss) < LOSS_TOLERANCE
    assert relative_error(grads, eager_grads) < GRAD_TOLERANCE


LIGER = """
import json, sys, torch
sys.path.insert(0, {root!r})
from tests.gpu.test_fused_kernels_gpu import step, relative_error
from models.kernels import use_liger_kernels
device = torch.device("cuda")
eager_loss, eager_grads = step(device)
assert use_liger_kernels()
loss, grads = step(device)
print(json.dumps({{"eager": eager_loss, "liger": loss, "grad_error": relative_error(grads, eager_grads)}}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger's kernels are Triton: CUDA only")
def test_liger_kernels_match_eager():
    result = subprocess.run([sys.executable, "-c", LIGER.format(root=str(ROOT))], capture_output=True, text=True,
                            timeout=300, cwd=ROOT, env={**os.environ})
    assert result.returncode == 0, result.stderr[-3000:]
    row = json.loads(result.stdout.strip().splitlines()[-1])
    print(row)
    assert abs(row["liger"] - row["eager"]) < LOSS_TOLERANCE and row["grad_error"] < GRAD_TOLERANCE


def test_the_loss_without_full_logits_equals_transformers(device):
    """models/loss.py on the device (Liger's fused kernel where installed) against ForCausalLMLoss, bf16 states."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    from models.loss import causal_lm_loss

    torch.manual_seed(0)
    head = torch.nn.Linear(256, 151936, bias=False, device=device, dtype=torch.bfloat16)
    hidden = torch.randn(2, 512, 256, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, 151936, (2, 512), device=device)
    labels[:, :100] = -100
    want = ForCausalLMLoss(head(hidden), labels, vocab_size=151936)
    got = causal_lm_loss(hidden, head, labels)
    assert abs(float(got) - float(want)) < LOSS_TOLERANCE
