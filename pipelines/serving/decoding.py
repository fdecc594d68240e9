"""Continuous batching for the Serve app: one decoding loop per replica that admits new questions at every step
(iteration-level scheduling, as vLLM and SGLang schedule) and hands each question its tokens as they exist, so plain
and streamed requests batch alike and no row waits for another to finish.

The decoder is transformers' own, with its own DynamicCache and no paged attention, so the running batch is kept the
way text-generation-inference keeps one for such models: new questions are prefilled apart (those over one memory
with one prompt length together), then joined to the running rows by left-padding the caches to one length; finished
rows are dropped, and padding that every remaining row has is trimmed. Rows over one memory decode as one forward over
that memory's prepared GCA keys/values (the GCA blocks fold the rows onto its one row: shared, never copied), each
row with its own question prior when the model routes lexically (GCAMemory.joined / question_rows); rows over other
memories, or none, are one forward each in the same step.

A row samples as `generate` would for its settings (greedy; or temperature, the decoder's top-k and the request's
top-p, through transformers' own logits warpers, drawn from the row's own generator when it has a seed, so a seeded
answer does not depend on what else is in the batch), and stops at an end token, at max_tokens, at its deadline or
when its client leaves.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from models.awareness import AwarenessModel
from models.gca import AnswerSoFar, GCAMemory

logger = logging.getLogger("ray.serve")
MIN_TEMPERATURE = 1e-4  # a temperature below this decodes greedily (its limit): dividing logits by less overflows


@dataclass(eq=False)
class Question:
    """One prompt to answer: what it asks, how to sample, and what the loop reports back (on its own thread)."""

    ids: list[int]
    memory: Any  # the served memory (pipelines.serving.memories: `.gca_memory`), or None
    max_tokens: int
    temperature: float = 0.0  # below MIN_TEMPERATURE: greedy
    top_p: float = 1.0
    seed: int | None = None
    deadline: float = float("inf")  # time.monotonic() by which it stops
    on_token: Callable[[int], None] | None = None  # each new token, as it exists
    on_done: Callable[[Question], None] | None = None  # once, when it has stopped (answered, failed or expired)
    cancelled: threading.Event = field(default_factory=threading.Event)  # set: stop at the next step
    tokens: list[int] = field(default_factory=list)  # what it generated, its end token included
    first: float | None = None  # time.perf_counter() when its first token existed
    expired: bool = False  # stopped at its deadline
    error: BaseException | None = None
    warpers: list[Any] = field(default_factory=list, repr=False)
    generator: torch.Generator | None = field(default=None, repr=False)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass(eq=False)
class _Rows:
    """Rows decoding together: one memory (or none), one cache, left-padded to one length."""

    questions: list[Question]
    cache: DynamicCache
    mask: torch.Tensor  # (B, L) long: 1 a cached token, 0 left padding
    last: torch.Tensor  # (B,) the token each row feeds next (sampled, not yet cached)
    gca: GCAMemory | None  # the memory with the rows' question priors, in row order


class DecodingLoop:
    """The replica's decoder, stepped on a thread of its own. `submit` a Question from any thread; the loop calls its
    `on_token` and `on_done` on its own thread. Every forward holds `lock` (the replica's model lock), so encoding a
    memory waits for one step, not for whole answers."""

    def __init__(self, model: AwarenessModel, eos_token_ids: list[int], max_rows: int, lock: threading.Lock):
        if max_rows < 1:
            raise ValueError(f"max_batch_size {max_rows}: give at least 1 (rows decoding at once)")
        self.model, self.decoder = model, model.decoder
        self.eos, self.max_rows, self.lock = set(eos_token_ids), int(max_rows), lock
        self.top_k = getattr(self.decoder.generation_config, "top_k", None)
        self.waiting: deque[Question] = deque()
        self.wake = threading.Condition()
        self.running: dict[int, _Rows] = {}  # id(memory's GCAMemory), or 0: no memory in the model's read
        # GET /v1/stats: decoding steps, rows decoded in them (rows / steps = the mean batch), prefills, forwards
        self.stats: dict[str, Any] = {"steps": 0, "rows": 0, "sizes": {}, "prefills": 0, "prefilled": 0,
                                      "forwards": 0, "forward_s": 0.0}
        self.thread = threading.Thread(target=self._run, name="decoding-loop", daemon=True)
        self.thread.start()

    def submit(self, question: Question) -> None:
        if question.temperature >= MIN_TEMPERATURE:
            question.warpers = [TemperatureLogitsWarper(question.temperature)]
            question.warpers += [TopKLogitsWarper(self.top_k)] if self.top_k else []
            question.warpers += [TopPLogitsWarper(question.top_p)] if question.top_p < 1 else []
            if question.seed is not None:
                question.generator = torch.Generator(self.model.device).manual_seed(question.seed)
        with self.wake:
            self.waiting.append(question)
            self.wake.notify()

    @property
    def rows(self) -> int:
        return sum(len(r.questions) for r in self.running.values())

    # ------------------------------------------------------------------------------------------------- the loop
    def _run(self) -> None:
        while True:
            with self.wake:
                while not self.waiting and not self.running:
                    self.wake.wait()
                admitted = []
                while self.waiting and self.rows + len(admitted) < self.max_rows:
                    admitted.append(self.waiting.popleft())
            try:
                self.step(admitted)
            except Exception as e:  # noqa: BLE001 - a bug here must fail its rows, not stop every later request
                logger.exception("decoding step failed")
                for rows in list(self.running.values()):
                    self._fail(rows.questions, e)
                self.running.clear()
                self._fail([q for q in admitted if not q.tokens and q.error is None], e)

    @torch.no_grad()
    def step(self, admitted: list[Question]) -> None:
        """Prefill what was admitted, then one token for every running row."""
        prefills: dict[tuple[int, int], list[Question]] = {}
        for q in admitted:
            if not self._stopped(q):
                prefills.setdefault((self._key(q), len(q.ids)), []).append(q)
        for (key, _), questions in prefills.items():
            try:
                new = self._prefill(questions)
            except Exception as e:  # noqa: BLE001 - these questions fail; the others go on
                logger.exception("prefill failed")
                self._fail(questions, e)
                continue
            if new is not None:
                self.running[key] = self._join(self.running[key], new) if key in self.running else new
        if not self.running:
            return
        active, sizes = self.rows, self.stats["sizes"]
        self.stats["steps"] += 1
        self.stats["rows"] += active
        sizes[str(active)] = sizes.get(str(active), 0) + 1
        for key, rows in list(self.running.items()):
            rows = self._keep(rows, [i for i, q in enumerate(rows.questions) if not self._stopped(q)])
            if rows is not None:
                try:
                    rows = self._decode(rows)
                except Exception as e:  # noqa: BLE001 - this memory's rows fail; the others go on
                    logger.exception("decoding failed")
                    self._fail(rows.questions, e)
                    rows = None
            if rows is None:
                del self.running[key]
            else:
                self.running[key] = rows

    def _key(self, q: Question) -> int:
        gca = q.memory.gca_memory if q.memory is not None else None
        return id(gca) if gca is not None else 0

    # ------------------------------------------------------------------------------------------------- forwards
    def _forward(self, input_ids: torch.Tensor, cache: DynamicCache, gca: GCAMemory | None, **kwargs) -> torch.Tensor:
        with self.lock:
            began = time.perf_counter()
            out = self.decoder(input_ids=input_ids, cache=cache, use_cache=True, gca_memory=gca, logits_to_keep=1,
                               **kwargs)
            self.stats["forwards"] += 1
            self.stats["forward_s"] += time.perf_counter() - began
        return out.logits[:, -1]

    def _prefill(self, questions: list[Question]) -> _Rows | None:
        """Questions over one memory with one prompt length, as one forward: their rows, or None when all stopped at
        their first token."""
        memory = questions[0].memory
        base = memory.gca_memory if memory is not None else None
        input_ids = torch.tensor([q.ids for q in questions], device=self.model.device)
        # with lexical routing each row's question prior, computed once here; the memory's cached K/V left as it was
        gca = self.model.with_question(base, input_ids, torch.ones_like(input_ids)) if base is not None else None
        cache = DynamicCache(config=self.decoder.config)
        logits = self._forward(input_ids, cache, gca)
        self.stats["prefills"] += 1
        self.stats["prefilled"] += len(questions)
        rows = _Rows(questions, cache, torch.ones_like(input_ids), self._sample(logits, questions), gca)
        return self._keep(rows, self._emit(rows))

    def _decode(self, rows: _Rows) -> _Rows | None:
        """One token for each row: its last token fed at its own position, over the left-padded cache."""
        mask = F.pad(rows.mask, (0, 1), value=1)
        positions = rows.mask.sum(dim=1, keepdim=True)  # the cached real tokens: the fed token's position
        window = self.model.token_window()
        if rows.gca is not None and window > 1:  # the fed tokens continue the rows' answers: the token prior's window
            rows.gca.answer = AnswerSoFar.continuing([q.tokens[max(0, len(q.tokens) - window):-1]
                                                      for q in rows.questions], 1, rows.last.device)
        logits = self._forward(rows.last[:, None], rows.cache, rows.gca, attention_mask=mask, position_ids=positions)
        rows.mask, rows.last = mask, self._sample(logits, rows.questions)
        return self._keep(rows, self._emit(rows))

    def _sample(self, logits: torch.Tensor, questions: list[Question]) -> torch.Tensor:
        """(B, V) next-token logits -> (B,) tokens: greedy rows the argmax, sampled rows through their warpers."""
        tokens = logits.argmax(dim=-1)
        for i, q in enumerate(questions):
            if q.warpers:
                scores = logits[i:i + 1].float()
                for warp in q.warpers:
                    scores = warp(None, scores)
                tokens[i] = torch.multinomial(scores.softmax(dim=-1), 1, generator=q.generator)[0, 0]
        return tokens

    def _emit(self, rows: _Rows) -> list[int]:
        """Hands each row its new token; the rows still going."""
        now, going = time.perf_counter(), []
        for i, (q, token) in enumerate(zip(rows.questions, rows.last.tolist())):
            q.tokens.append(token)
            q.first = q.first or now
            if q.on_token is not None:
                q.on_token(token)
            if token in self.eos or len(q.tokens) >= q.max_tokens:
                self._done(q)
            else:
                going.append(i)
        return going

    # ------------------------------------------------------------------------------------------------- the batch
    def _join(self, rows: _Rows, new: _Rows) -> _Rows:
        """Two batches over one memory as one: each left-padded to the longer cache."""
        length = max(rows.mask.shape[1], new.mask.shape[1])

        def left(x: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            return F.pad(x, (0, 0) * (dim_from_end - 1) + (length - x.shape[-dim_from_end], 0))

        cache = DynamicCache(config=self.decoder.config)
        for i, (a, b) in enumerate(zip(rows.cache.layers, new.cache.layers)):
            cache.update(torch.cat([left(a.keys, 2), left(b.keys, 2)]), torch.cat([left(a.values, 2),
                                                                                   left(b.values, 2)]), i)
        gca = rows.gca.joined(new.gca) if rows.gca is not None else None
        return _Rows(rows.questions + new.questions, cache, torch.cat([left(rows.mask, 1), left(new.mask, 1)]),
                     torch.cat([rows.last, new.last]), gca)

    def _keep(self, rows: _Rows, keep: list[int]) -> _Rows | None:
        """Only the rows `keep` (None when none), without the padding columns every one of them has."""
        if not keep:
            return None
        if len(keep) == len(rows.questions):
            return rows
        index = torch.tensor(keep, device=rows.mask.device)
        mask = rows.mask.index_select(0, index)
        lead = int((mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())  # columns padding in every kept row
        cache = DynamicCache(config=self.decoder.config)
        for i, layer in enumerate(rows.cache.layers):
            cache.update(layer.keys.index_select(0, index)[:, :, lead:],
                         layer.values.index_select(0, index)[:, :, lead:], i)
        gca = rows.gca.question_rows(index) if rows.gca is not None else None
        return _Rows([rows.questions[i] for i in keep], cache, mask[:, lead:], rows.last.index_select(0, index), gca)

    # ------------------------------------------------------------------------------------------------- endings
    def _stopped(self, q: Question) -> bool:
        """Ends a question whose client left or whose time ran out; True if it has ended."""
        if q.cancelled.is_set() or time.monotonic() > q.deadline:
            q.expired = not q.cancelled.is_set()
            self._done(q)
            return True
        return False

    def _fail(self, questions: list[Question], error: BaseException) -> None:
        for q in questions:
            q.error = error
            self._done(q)

    @staticmethod
    def _done(q: Question) -> None:
        if q.on_done is not None:
            try:
                q.on_done(q)
            except Exception:  # noqa: BLE001 - a caller's callback must not stop the loop
                logger.exception("a question's on_done failed")
            q.on_done = None
