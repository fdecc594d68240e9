"""The traffic VLM's pyfunc: logged from code into a run and registered, loaded back through MLflow, it answers a
held-out scene given as PNG bytes or as base64 text exactly as the model it was logged from; bad input is refused
with what to pass."""

from __future__ import annotations

import base64

import mlflow.pyfunc
import pandas as pd
import pytest
import torch

from models.traffic_vlm import build_traffic_vlm, tiny_vision_config
from pipelines.data.traffic_scenes import make_row, pixel_values, scene_seeds
from pipelines.data.traffic_tokenizer import NO, YES, build_traffic_tokenizer, save_traffic_tokenizer
from pipelines.serving.traffic_pyfunc import _rows
from pipelines.tracking.registry import log_traffic_pyfunc
from pipelines.tracking.tracker import Tracker


def test_logged_pyfunc_answers_held_out_scenes_as_the_model(tmp_path):
    tokenizer = build_traffic_tokenizer()
    torch.manual_seed(0)
    model = build_traffic_vlm(
        yes_id=tokenizer.token_to_id(YES), no_id=tokenizer.token_to_id(NO),
        vision_config=tiny_vision_config(image_size=64, hidden_size=48, layers=1, heads=4), vocab_size=500,
        hidden_size=32, intermediate_size=64, layers=1, heads=4, kv_heads=2, max_positions=32).eval()
    export = tmp_path / "export"
    model.save_pretrained(export)
    save_traffic_tokenizer(export)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker.start(uri, "traffic-test", "run", {"job": "traffic_vlm"}, {"job": "traffic_vlm"})
    logged = log_traffic_pyfunc(tracker, str(export), "traffic-vlm-test")
    assert logged == {"pyfunc": f"runs:/{tracker.run_id}/pyfunc", "registered": "models:/traffic-vlm-test/1"}, logged
    tracker.close()

    rows = [make_row(s) for s in scene_seeds("heldout", 8)]
    encodings = tokenizer.encode_batch([r["question"] for r in rows])
    with torch.no_grad():
        want = model.classify(torch.from_numpy(pixel_values([r["png"] for r in rows], size=64)),
                              torch.tensor([e.ids for e in encodings]),
                              torch.tensor([e.attention_mask for e in encodings]))
    want = ["yes" if w else "no" for w in want.tolist()]
    mlflow.set_tracking_uri(uri)
    try:
        served = mlflow.pyfunc.load_model("models:/traffic-vlm-test@candidate")
    finally:
        mlflow.set_tracking_uri(None)  # no global left behind
    frame = pd.DataFrame({"image": [r["png"] for r in rows], "question": [r["question"] for r in rows]})
    assert served.predict(frame) == want
    as_text = [{"image": base64.b64encode(r["png"]).decode(), "question": r["question"]} for r in rows]
    assert served.unwrap_python_model().predict(None, as_text) == want


def test_bad_rows_name_what_to_pass():
    png = make_row(0)["png"]
    with pytest.raises(ValueError, match="row 0: each input needs 'image'"):
        _rows([{"question": "Is the light red?"}])
    with pytest.raises(ValueError, match="row 1: 'image' is text but not base64"):
        _rows([{"image": png, "question": "q"}, {"image": "not base64!", "question": "q"}])
    with pytest.raises(ValueError, match="not a PNG image"):
        _rows({"image": b"GIF89a....", "question": "q"})
    assert _rows({"image": base64.b64encode(png).decode(), "question": "q"}) == [(png, "q")]
