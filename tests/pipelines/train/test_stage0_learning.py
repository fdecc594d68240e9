"""The embedded default's learning claim, at full length (about 10 minutes): `make test-slow`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray  # every test here starts Ray

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_default_stage0_run_learns_to_read_its_memory(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "jobs" / "stage0.py"), "--run.storage_path",
                             str(tmp_path / "ray")], cwd=tmp_path, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    print(json.dumps(summary))  # shown by `pytest -rA`: the numbers the README reports
    assert summary["needle_accuracy"] >= 0.9, summary
    assert summary["no_memory_accuracy"] <= 0.2, summary
    assert summary["gate_abs_mean"] > max(0.05, summary["gate_abs_init"] + 0.05), summary  # opened further
    # the README's registry example, asked of this model through the served pyfunc's own code
    import types

    from pipelines.tracking.pyfunc import AwarenessPyfunc, ensure_tokenizer
    from models import AwarenessConfig
    from tests.pipelines.tracking.test_registry import readme_registry_example

    ensure_tokenizer(AwarenessConfig.load(Path(summary["export"])).decoder)
    served = AwarenessPyfunc()
    served.load_context(types.SimpleNamespace(artifacts={"export": summary["export"]},
                                              model_config={"max_new_tokens": 4, "eos_token": "<eos>"}))
    memory, questions, answers = readme_registry_example()
    assert served.predict(None, [{"question": q, "memory": memory} for q in questions]) == answers
