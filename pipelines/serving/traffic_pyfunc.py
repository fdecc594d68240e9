"""The traffic-scene VLM as an MLflow pyfunc: rows of {image: PNG bytes or base64 text, question} in, "yes" / "no"
out. The logged model holds the job's whole export (vision tower, decoder, tokenizer.json) as its artifact and is
logged from code (`traffic_pyfunc_entry.py`, by pipelines.tracking.registry.log_traffic_pyfunc), with this
repository's models/ and pipelines/ as code paths and stated requirements."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import mlflow.pyfunc
import torch

from models.traffic_vlm import TrafficVLM
from pipelines.data.traffic_scenes import pixel_values
from pipelines.data.traffic_tokenizer import load_traffic_tokenizer

class TrafficPyfunc(mlflow.pyfunc.PythonModel):
    """predict(rows of {image, question}) -> ["yes" | "no", ...]: the [YES]/[NO] logits at the question's last token."""

    def load_context(self, context) -> None:
        export = context.artifacts["export"]
        self.model = TrafficVLM.from_pretrained(export).eval()
        self.tokenizer = load_traffic_tokenizer(export)
        self.image_size = int(self.model.vision.config.image_size)

    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> list[str]:
        rows = _rows(model_input)
        if not rows:
            return []
        encodings = self.tokenizer.encode_batch([question for _, question in rows])
        pixels = torch.from_numpy(pixel_values([image for image, _ in rows], size=self.image_size))
        ids = torch.tensor([e.ids for e in encodings])
        mask = torch.tensor([e.attention_mask for e in encodings])
        return ["yes" if yes else "no" for yes in self.model.classify(pixels, ids, mask).tolist()]


def _rows(model_input) -> list[tuple[bytes, str]]:
    """(PNG bytes, question) from a DataFrame with columns image and question, a dict, or a list of dicts."""
    if hasattr(model_input, "to_dict"):
        model_input = model_input.to_dict(orient="records")
    if isinstance(model_input, dict):
        model_input = [model_input]
    rows = []
    for i, row in enumerate(model_input):
        if "image" not in row or "question" not in row:
            raise ValueError(f"row {i}: each input needs 'image' (PNG bytes, or the PNG base64-encoded as text) and "
                             f"'question' (text); got {sorted(row)}")
        rows.append((_png(row["image"], i), str(row["question"])))
    return rows


def _png(image, i: int) -> bytes:
    if isinstance(image, str):
        try:
            image = base64.b64decode(image, validate=True)
        except binascii.Error:
            raise ValueError(f"row {i}: 'image' is text but not base64: pass PNG bytes or base64-encode them") from None
    if not isinstance(image, bytes | bytearray) or not bytes(image[:8]) == b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"row {i}: 'image' is not a PNG image: pass the bytes of a PNG file (or their base64 text)")
    return bytes(image)
