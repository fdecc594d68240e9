"""A dense retriever made of the memory encoder: the dense-rag baseline's retriever (jobs/retriever.py trains it
contrastively on the needle task's questions and evidence chunks; pipelines.data.memory_modes reads with it).

One encoder embeds both sides, questions and chunks, as Qwen3-Embedding does. The embedding is the masked mean of
the encoder's states, unit length: the encoder reads bidirectionally here (the stage-0 pair's setting), where
Qwen3-Embedding's last-token pooling assumes causal attention.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Model

from models.loading import load_encoder
from models.memory import ENCODER_ATTENTIONS, EncoderAttention, MemoryEncoder

RETRIEVER_FILE = "retriever.json"  # in a retriever export, beside the encoder's config.json and safetensors


class DenseRetriever(nn.Module):
    """Question and chunk embeddings from one MemoryEncoder; its forward is the contrastive loss of a batch."""

    def __init__(self, encoder: Qwen3Model, attention: EncoderAttention = "bidirectional",
                 temperature: float = 0.05):
        super().__init__()
        if attention not in ENCODER_ATTENTIONS:
            raise ValueError(f"attention must be one of {ENCODER_ATTENTIONS}, got {attention!r}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.memory = MemoryEncoder(encoder, attention)
        self.temperature = temperature

    def embed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Rows (N, L) of token ids and their mask (1: a token, 0: padding) -> unit embeddings (N, H)."""
        states, real = self.memory(ids[:, None, :], mask[:, None, :])  # (N, L, H), (N, L)
        real = real.to(states.dtype)[..., None]
        pooled = (states * real).sum(1) / real.sum(1).clamp(min=1.0)
        return F.normalize(pooled.float(), dim=-1)

    def forward(self, query_ids: torch.Tensor, query_mask: torch.Tensor, chunk_ids: torch.Tensor,
                chunk_mask: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
        """The contrastive loss of Q questions against C chunks; positives (Q, C) marks each question's evidence."""
        logits = self.embed(query_ids, query_mask) @ self.embed(chunk_ids, chunk_mask).T / self.temperature
        return contrastive_loss(logits, positives)

    @torch.no_grad()
    def scores_side(self, rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Embeddings (N, H) on the CPU of padded rows (padded_rows' ids and mask), without a graph: one side of a
        retrieval's cosine scores."""
        device = next(self.parameters()).device
        return self.embed(*(t.to(device) for t in rows)).cpu()

    def scores(self, chunks: list[list[int]], queries: list[list[int]]) -> torch.Tensor:
        """Cosine similarity (Q, C) of each query to each chunk, token-id lists of any lengths."""
        return self.scores_side(padded_rows(queries)) @ self.scores_side(padded_rows(chunks)).T

    def save_pretrained(self, directory: str | Path) -> None:
        """The encoder as a plain Qwen3 checkpoint (safetensors) and how it embeds, in RETRIEVER_FILE."""
        directory = Path(directory)
        self.memory.encoder.save_pretrained(directory)
        (directory / RETRIEVER_FILE).write_text(json.dumps(
            {"attention": self.memory.attention, "pooling": "mean", "temperature": self.temperature}, indent=1))

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> "DenseRetriever":
        directory = Path(directory).expanduser()
        settings_file = directory / RETRIEVER_FILE
        if not settings_file.is_file():
            raise FileNotFoundError(f"{str(directory)!r} has no {RETRIEVER_FILE}: pass a retriever export "
                                    f"(jobs/retriever.py writes <checkpoint>/export)")
        settings = json.loads(settings_file.read_text())
        encoder = load_encoder(directory, dtype=torch.float32, device=device)
        return cls(encoder, settings["attention"], settings["temperature"]).eval()


def top_k(scores: torch.Tensor, k: int) -> list[list[int]]:
    """Per row of scores (Q, C), the indices of the k highest, best first (ties: memory order)."""
    return scores.argsort(dim=1, descending=True, stable=True)[:, : min(k, scores.shape[1])].tolist()


def contrastive_loss(logits: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """Mean over (question, evidence chunk) pairs of -log(e^s_p / (e^s_p + sum over the question's negatives e^s_n)),
    the negatives being every chunk that is not its evidence. Each evidence chunk of a question whose answer needs
    several is a target of its own: a retriever must rank all of them, not one, above the rest."""
    negatives = torch.logsumexp(logits.masked_fill(positives, float("-inf")), dim=1, keepdim=True)  # (Q, 1)
    log_p = logits - torch.logaddexp(logits, negatives)  # (Q, C): each chunk as the one positive
    return -log_p[positives].mean()


def padded_rows(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows right-padded to the longest: ids (N, L) and mask (N, L). Padding reads id 0 under mask 0."""
    width = max(1, max((len(r) for r in rows), default=1))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids, mask
