"""The question's lexical prior for chunk routing (`memory_lexical_routing`): a chunk that holds the question's rare
tokens is scored up before the top-k, as BM25 would rank it.

Why: a learned router scores a chunk by dot products of 16-128 dimensional keys, and among many chunks of near-alike
facts (a repository's definitions, a needle among similar keys) the right one is often in its top 4 but rarely first;
the read then mixes in the look-alikes and answers from the wrong one (docs/evaluation.md, "hybrid routing"). An exact
token match tells them apart at no cost: the chunk naming the asked identifier is the one to read. Hybrid retrieval
(lexical + dense) is the usual answer in retrieval, and here it only steers which chunks are read; what is read and
how it is mixed is still learned.

The prior of a decoder row is computed once from its question (the prompt's tokens, never its answer's), so a decoding
step pays nothing for it beyond adding a (C,) vector to the chunk scores. Scores are BM25's idf without term
frequency: for each distinct question token present in the memory, idf = ln(1 + (C - n + 0.5) / (n + 0.5)), n the
chunks that hold it, added to every chunk that holds it. Both sides share the tokenizer (a pair's encoder and decoder
ids name the same tokens), so ids are compared directly.

The token prior (`memory_lexical_tokens`) is the same score for one token, each query its own: the chunks holding the
token a query position reads (in a decoding step, the token just generated) gain its idf. An answer that names a key
then reads that key's chunk next, where the question's words do not lead (a two_hop chain's second fact). Each memory's
distinct tokens are indexed once (`TokenIndex`), so a step looks its token up in O(log V + C).

The answer's window (`memory_lexical_window` W > 1): a query in the answer takes, on each chunk, the largest token prior
of the answer's last W tokens (its own among them), so a named key keeps its chunk read while the value it binds is
written: a two_hop answer `kb d d d` reads kb's chunk at every digit, where a digit's own prior scores every chunk
holding that digit and the router alone loses the chunk past the sizes it trained on. The largest, not the sum: a query
scores chunks on the scale one token gives, whatever the window. Question tokens keep their own token only: the
question prior speaks for the question.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_TOKEN = torch.iinfo(torch.long).max  # sorts after every token id
NO_TOKEN = -1  # a window position holding no token: no chunk holds it


def question_prior(question_ids: torch.Tensor, question_mask: torch.Tensor, chunk_ids: torch.Tensor,
                   chunk_mask: torch.Tensor) -> torch.Tensor:
    """Question tokens (B_mem, R, T) with their mask (B_mem, R, T) bool (which tokens form the question), the
    memory's chunks (B_mem, C, L) with their token mask (B_mem, C, L) bool -> the prior (B_mem, R, C) float32: the
    summed idf of the distinct question tokens each chunk holds. A chunk of padding only scores 0."""
    b, rows, t = question_ids.shape
    holds = torch.stack([_held(question_ids[m].flatten(), chunk_ids[m], chunk_mask[m]).view(rows, t, -1)
                         for m in range(b)])  # (B_mem, R, T, C): which chunks hold each question token
    earlier = question_ids[..., :, None] == question_ids[..., None, :]  # (B_mem, R, T, T): token i == token j
    before = torch.ones(t, t, dtype=torch.bool, device=question_ids.device).tril(-1)  # j < i
    repeated = (earlier & before & question_mask[..., None, :]).any(-1)  # an earlier question token is the same
    counted = question_mask & ~repeated  # (B_mem, R, T): each distinct question token once
    chunks = chunk_mask.any(-1).sum(-1).float()[:, None, None]  # (B_mem, 1, 1): real chunks
    held_by = holds.sum(-1).float()  # (B_mem, R, T)
    return (holds.float() * (idf(chunks, held_by) * counted)[..., None]).sum(2)


@dataclass(frozen=True)
class TokenIndex:
    """Each memory's distinct chunk tokens, sorted (B_mem, V) and padded with PAD_TOKEN, which chunks hold each
    (B_mem, V, C) bool, and its idf (B_mem, V) float32 (0 on padding)."""

    tokens: torch.Tensor
    held: torch.Tensor
    idf: torch.Tensor

    @classmethod
    def of(cls, chunk_ids: torch.Tensor, chunk_mask: torch.Tensor) -> "TokenIndex":
        """The memory's chunks (B_mem, C, L) and their token mask (B_mem, C, L) bool."""
        b, c = chunk_ids.shape[:2]
        vocabularies = [torch.unique(chunk_ids[m][chunk_mask[m]]) for m in range(b)]
        v = max(1, max(len(vocab) for vocab in vocabularies))
        tokens = torch.full((b, v), PAD_TOKEN, dtype=chunk_ids.dtype, device=chunk_ids.device)
        held = torch.zeros(b, v, c, dtype=torch.bool, device=chunk_ids.device)
        for m, vocab in enumerate(vocabularies):
            tokens[m, : len(vocab)] = vocab
            held[m, : len(vocab)] = _held(vocab, chunk_ids[m], chunk_mask[m])
        chunks = chunk_mask.any(-1).sum(-1).float()[:, None]  # (B_mem, 1): real chunks
        return cls(tokens=tokens, held=held, idf=idf(chunks, held.sum(-1).float()))

    def prior(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (B_mem, Q) -> the token prior (B_mem, Q, C) float32: each token's idf on the chunks holding it;
        0 for a token no chunk holds."""
        at = torch.searchsorted(self.tokens, ids.to(self.tokens.dtype)).clamp_max(self.tokens.shape[1] - 1)
        found = self.tokens.gather(1, at) == ids
        held = self.held.gather(1, at[..., None].expand(-1, -1, self.held.shape[-1]))  # (B_mem, Q, C)
        return held * (self.idf.gather(1, at) * found)[..., None]


def answer_windows(ids: torch.Tensor, answer: torch.Tensor, window: int,
                   before: torch.Tensor | None = None) -> torch.Tensor:
    """A forward's tokens (B, T), which of them are answer tokens (B, T) bool, and each row's answer tokens before
    them (B, A), NO_TOKEN where a row's answer is shorter (None: none) -> (B, T, W) token ids, the position's own token
    last: an answer token's window holds the tokens of its answer's last W positions, a question token's its own
    alone, and NO_TOKEN elsewhere (before the answer began, or at a question token)."""
    b = ids.shape[0]
    before = ids.new_full((b, 0), NO_TOKEN) if before is None else before[:, max(0, before.shape[1] - window + 1):]
    lead = window - 1 - before.shape[1]
    tokens = torch.cat([ids.new_full((b, lead), NO_TOKEN), before, ids], dim=1).unfold(1, window, 1)  # (B, T, W)
    answered = torch.cat([answer.new_zeros(b, lead), before != NO_TOKEN, answer], dim=1).unfold(1, window, 1)
    in_run = answered.flip(-1).long().cumprod(-1).flip(-1).bool()  # every position from there to the query answers
    in_run[..., -1] = True  # the query's own token, answer or question
    return tokens.masked_fill(~in_run, NO_TOKEN)


def idf(chunks: torch.Tensor, held_by: torch.Tensor) -> torch.Tensor:
    """BM25's idf of a token held by `held_by` of a memory's `chunks` chunks; 0 for a token no chunk holds."""
    return torch.log1p((chunks - held_by + 0.5) / (held_by + 0.5)) * (held_by > 0)


def question_mask_of(input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                     labels: torch.Tensor | None, ignore_index: int = -100) -> torch.Tensor:
    """Which tokens of each row (B, T) are its question: the attended tokens before the row's first labelled one
    (labels mark the answer in training and teacher-forced scoring), or every attended token without labels (a
    prompt given to generate)."""
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if labels is not None:
        answered = (labels != ignore_index).long().cumsum(-1) > 0  # from the first answer token on
        mask = mask & ~answered
    return mask


def packed_question_prior(input_ids: torch.Tensor, segment_ids: torch.Tensor, labels: torch.Tensor | None,
                          chunk_ids: torch.Tensor, chunk_mask: torch.Tensor, memory_segments: torch.Tensor,
                          ignore_index: int = -100) -> torch.Tensor:
    """Packed rows: several examples a row (segment_ids (B, T), -1 padding), each with its own chunks
    (memory_segments (B, C), -1 padding) -> the prior of each token's example's question, per token (B, T, C): as
    `question_prior` gives each example alone (its question: its tokens before its first label; idf over its own
    chunks), 0 on other examples' chunks and on padding."""
    b, t = input_ids.shape
    segments = int(max(segment_ids.max(), memory_segments.max(), 0)) + 1
    own = segment_ids[..., None] == torch.arange(segments, device=input_ids.device)  # (B, T, S)
    answer = (labels != ignore_index) if labels is not None else torch.zeros_like(own[..., 0])
    answered = ((answer[..., None] & own).long().cumsum(1) > 0) & own  # an earlier label in the token's example
    asked = (segment_ids >= 0) & ~answered.any(-1)  # (B, T): question tokens
    same = segment_ids[..., :, None] == segment_ids[..., None, :]  # (B, T, T)
    before = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril(-1)
    repeated = (same & before & asked[..., None, :] & (input_ids[..., :, None] == input_ids[..., None, :])).any(-1)
    counted = asked & ~repeated
    real = chunk_mask.any(-1) & (memory_segments >= 0)  # (B, C)
    mine = (segment_ids[..., None] == memory_segments[:, None, :]) & real[:, None, :]  # (B, T, C): its example's
    holds = torch.stack([_held(input_ids[row], chunk_ids[row], chunk_mask[row]) for row in range(b)]) & mine
    chunks = mine.sum(-1).float()  # (B, T): real chunks of the token's example
    held_by = holds.sum(-1).float()
    contribution = holds.float() * (idf(chunks, held_by) * counted)[..., None]  # (B, T, C)
    per_example = own.float().transpose(1, 2) @ contribution  # (B, S, C)
    return per_example.gather(1, segment_ids.clamp_min(0)[..., None].expand(b, t, per_example.shape[-1])) * \
        (segment_ids >= 0)[..., None]


def _held(tokens: torch.Tensor, chunk_ids: torch.Tensor, chunk_mask: torch.Tensor) -> torch.Tensor:
    """tokens (T,), one row's chunks (C, L) and their mask -> (T, C) bool: the chunk holds the token. Over the row's
    own small vocabulary (torch.unique), so it costs O(T + C*L), not T x C x L."""
    c = chunk_ids.shape[0]
    vocab, inverse = torch.unique(torch.cat([tokens, chunk_ids.flatten()]), return_inverse=True)
    presence = torch.zeros(c, len(vocab), dtype=torch.bool, device=tokens.device)
    rows = torch.arange(c, device=tokens.device).repeat_interleave(chunk_ids.shape[1])
    presence[rows[chunk_mask.flatten()], inverse[len(tokens):][chunk_mask.flatten()]] = True
    return presence[:, inverse[: len(tokens)]].T  # (T, C)
