"""benchmarks/memory_routing.py as documented, with the stage-0 preset's reading (k = 2, router-mixed chunks, the
question's lexical prior): it prints one table row per memory size, full attention beside routing."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("tokens", [[], ["--lexical-tokens"], ["--lexical-tokens", "--lexical-window", "4"]])
def test_the_quick_run_prints_a_row_per_size_for_the_presets_reading(tokens):
    done = subprocess.run([sys.executable, "benchmarks/memory_routing.py", "--quick", "--top-k", "2", "--chunk-weights",
                           "router", "--lexical", "1", "--chunk-len", "24", "--threads", "1", *tokens], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = (", token prior" if tokens else "") + (", window 4" if len(tokens) > 1 else "")
    assert f"chunk weights router, lexical prior 1.0{shown}\n" in done.stdout
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("|") and "---" not in line]
    assert [int(r[0].replace(",", "")) for r in rows[1:]] == [1008, 4080]  # whole chunks of 24 tokens
    assert all(float(r[2]) > 0 and float(r[3]) > 0 for r in rows[1:])


def test_a_routed_decoder_holds_its_prompts_prior_and_steps_never_recompute_it(monkeypatch):
    """generate computes the question's lexical prior once; the benchmark's decoder must too, or every step pays an
    O(memory) prior of the last token instead (what it once timed at 64k)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_routing

    model = memory_routing.build(2, "gca", "upper_half", "router", 1.0)
    states = torch.randn(1, 8, 24, model.memory_encoder.hidden_size)
    ids = torch.randint(0, 496, (1, 8, 24))
    prompt = torch.cat([torch.tensor([[1]]), ids[:, 3, :3]], 1)  # the question names chunk 3's tokens
    decoder = memory_routing.Decoder(model, 2, states, torch.ones(1, 8, 24, dtype=torch.bool), prompt, ids)
    priors = [kv.routing.prior for kv in decoder.memory.layers.values() if kv.routing is not None]
    assert priors and all(p is not None and int(p[0, 0].argmax()) == 3 for p in priors)
    calls = []
    monkeypatch.setattr(type(model), "with_question", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        decoder.step()
    assert not calls


def test_turns_of_several_calls_time_all_but_the_first_of_each():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from timing import timed_side_by_side

    calls = {"a": 0, "b": 0}

    def side(name):
        return lambda: calls.__setitem__(name, calls[name] + 1)

    assert len(timed_side_by_side([side("a"), side("b")], repeats=3, block=4)) == 2
    assert calls == {"a": 1 + 3 * 4, "b": 1 + 3 * 4}  # one warm-up, then 3 turns of 4 calls each
