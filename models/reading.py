"""How a memory-reading layer reads the memory: chunk routing and the length-aware scale (models/gca.py), one value
handed whole to the builders and modules that read it, validated in one place."""

from __future__ import annotations

from dataclasses import dataclass, replace

NAME_PREFIX = "memory_"  # the options' names in configs, flags and saved files: memory_top_k, memory_summaries, ...
CHUNK_WEIGHTS = ("attention", "router")  # how routing mixes a query's chosen chunks (models/gca.py)


@dataclass(frozen=True)
class MemoryReading:
    """The chunk-routing options and the length-aware scale, as a model is built with them."""

    # Chunk routing (gca and cross; models/gca.py): each query reads only the memory chunks its top-k summary keys
    # score highest, exact attention over their tokens; > 0 adds a small router per block, trained by the routing loss.
    # 0: the whole memory (full attention)
    top_k: int = 0
    # Weight of the routing loss (KL from full attention's chunk mass to the router's), added in training with
    # memory_top_k > 0; it reaches the routers only. 0: the routers do not learn
    routing_loss: float = 1.0
    # With routing: summary keys per chunk, one per block of chunk_len / this tokens, a chunk scoring its best block
    # (must divide the chunk length): one vector per chunk cannot hold every key of a chunk full of similar facts
    summaries: int = 1
    # With routing: how a query's chosen chunks are mixed. attention: one softmax over their tokens (k >= the chunk
    # count is full attention). router: Grouped Cross Attention's fusion, a softmax inside each chunk and the chunk
    # outputs weighted by the softmax of their router scores, so the answer loss trains the routers too
    chunk_weights: str = "attention"
    # With routing: the weight of the question's lexical prior on the chunk scores (models/lexical.py): a chunk holding
    # the question's rare tokens is scored up by their idf, as BM25 ranks, so among near-alike chunks the one naming
    # what is asked is read. 0: the learned router alone
    lexical_routing: float = 0.0
    # With lexical routing: the prior's weight when the model reads in eval mode (evaluation, generate, serving);
    # None: memory_lexical_routing. A router trained beside a small prior still learns to rank; a larger prior when
    # reading outvotes it where it misranks
    lexical_reading: float | None = None
    # With lexical routing (fusion gca): a learned gate per query token on the prior, 2 sigmoid(w x + b) of the block's
    # input (1 at initialisation), so a token that no longer asks the question, e.g. the key a two_hop answer names
    # before reading it, can turn the question's prior down: the prior stays one input and cannot veto a learned match
    lexical_gate: bool = False
    # With lexical routing: each query token also scores up the chunks holding its own token, by that token's idf (the
    # token prior): a decoder that names a key, e.g. the next key of a two_hop answer, reads that key's chunk at once,
    # the seed's <read> without a second pass. With lexical_gate, a second gate output weighs it per token
    lexical_tokens: bool = False
    # With the token prior: an answer token takes, on each chunk, the largest token prior of its answer's last this
    # many tokens (models/lexical.py), so a key the answer names keeps its chunk read while its value is written.
    # 1: each token its own
    lexical_window: int = 1
    # With the token prior: the window when the model reads in eval mode (evaluation, generate, serving); None:
    # memory_lexical_window. A model trained on each token's own prior reads its two_hop chains past the trained
    # sizes with the window, and keeps what it learned on the tasks whose answers move from chunk to chunk
    lexical_reading_window: int | None = None
    # With a window > 1: an earlier answer token's prior counts at this fraction of its weight, the token's own at
    # all of it, so a key the answer named still scores its chunk up but no longer outranks the chunk the token
    # itself names (a second value's first digit). 1: every token of the window alike
    lexical_window_carry: float = 1.0
    # Length-aware scale (gca and cross): queries times max(1, log n / log N), n the real memory tokens a query
    # reads; N: the memory length trained at (a larger memory then sharpens instead of diluting). 0: off
    logn_scale: int = 0

    @property
    def routes(self) -> bool:
        """Each query reads only its top-k chunks (a model built so has routers)."""
        return self.top_k > 0

    def with_top_k(self, k: int) -> "MemoryReading":
        """These options reading k chunks a query; k = 0 (the whole memory) also turns routing's companions off (the
        router's chunk weights, the lexical prior), which mean nothing without it. The logn scale stays."""
        if k:
            return replace(self, top_k=k)
        return replace(self, top_k=0, chunk_weights="attention", lexical_routing=0.0, lexical_reading=None,
                       lexical_gate=False, lexical_tokens=False, lexical_window=1,
                       lexical_reading_window=None, lexical_window_carry=1.0)

    def lexical_weight(self, training: bool) -> float:
        """The question prior's weight: lexical_routing in training, lexical_reading (when set) in eval mode."""
        return self.lexical_routing if training or self.lexical_reading is None else self.lexical_reading

    def token_window(self, training: bool) -> int:
        """The token prior's window: lexical_window in training, lexical_reading_window (when set) in eval mode."""
        return self.lexical_window if training or self.lexical_reading_window is None else self.lexical_reading_window

    def problems(self, fusion: str | None = None, prefix: str = NAME_PREFIX) -> list[str]:
        """Every problem of these options, each naming its option as `prefix` + field (`memory_top_k`, or a config's
        `model.memory_top_k`). With a `fusion`: also whether it reads a memory-only attention to route and scale."""
        p: list[str] = []
        if self.top_k < 0:
            p.append(f"{prefix}top_k must be 0 (full attention) or the chunks each query reads, got {self.top_k}")
        if self.logn_scale < 0 or self.logn_scale == 1:
            p.append(f"{prefix}logn_scale must be 0 (off) or the memory length trained at (n_train >= 2), got "
                     f"{self.logn_scale}")
        if self.routing_loss < 0:
            p.append(f"{prefix}routing_loss must be >= 0, got {self.routing_loss}")
        if self.summaries < 1:
            p.append(f"{prefix}summaries must be >= 1 (summary keys per chunk for routing), got {self.summaries}")
        if self.chunk_weights not in CHUNK_WEIGHTS:
            p.append(f"{prefix}chunk_weights must be one of {', '.join(CHUNK_WEIGHTS)}, got {self.chunk_weights!r}")
        elif self.chunk_weights == "router" and (not self.top_k or self.logn_scale):
            p.append(f"{prefix}chunk_weights router mixes routing's top-k chunks by their scores, so it needs "
                     f"{prefix}top_k > 0 and {prefix}logn_scale 0 (one softmax per chunk has no memory length to scale "
                     f"by): set {prefix}top_k (e.g. 2)")
        if self.lexical_routing < 0 or (self.lexical_routing and not self.top_k):
            p.append(f"{prefix}lexical_routing ({self.lexical_routing}) weighs the question's lexical prior on "
                     f"routing's chunk scores: give a weight >= 0, and {prefix}top_k > 0 with a positive one")
        if self.lexical_reading is not None and (self.lexical_reading < 0 or not self.lexical_routing):
            p.append(f"{prefix}lexical_reading ({self.lexical_reading}) is the lexical prior's weight when reading: "
                     f"give a weight >= 0 with a positive {prefix}lexical_routing (the prior trained with), or None")
        if self.lexical_gate and (not self.lexical_routing or fusion == "cross"):
            p.append(f"{prefix}lexical_gate scales the lexical prior per query token in the GCA blocks: it needs "
                     f"{prefix}lexical_routing > 0 and fusion gca")
        if self.lexical_tokens and not self.lexical_routing:
            p.append(f"{prefix}lexical_tokens adds each query token's own lexical prior to routing's chunk scores: it "
                     f"needs {prefix}lexical_routing > 0 (the weight of both priors)")
        for name in ("lexical_window", "lexical_reading_window"):
            window = getattr(self, name)
            if window is not None and (window < 1 or (window > 1 and not self.lexical_tokens)):
                p.append(f"{prefix}{name} ({window}) is how many of the answer's last tokens the token prior reads: "
                         f"give 1 (its own token) or more with {prefix}lexical_tokens true")
        if not 0 < self.lexical_window_carry <= 1:
            p.append(f"{prefix}lexical_window_carry ({self.lexical_window_carry}) is the fraction of its prior an "
                     f"earlier answer token keeps in the window: give a value in (0, 1]")
        if fusion == "merged" and (self.top_k or self.logn_scale):
            # merged attention shares one softmax between the decoder's own tokens and the memory: neither routing
            # nor the scale fits there without changing the pretrained attention
            p.append(f"{prefix}top_k and {prefix}logn_scale route and scale a memory-only attention (fusion gca or "
                     f"cross); fusion='merged' reads the memory in the decoder's own softmax: set them to 0 or use "
                     f"fusion gca or cross")
        return p

    def check(self, fusion: str | None = None) -> "MemoryReading":
        """Raises one ValueError naming every problem (models' builders); returns the options."""
        problems = self.problems(fusion)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @classmethod
    def from_names(cls, data: dict, prefix: str = NAME_PREFIX) -> "MemoryReading":
        """The options from prefixed names (`memory_top_k`, ...), as configs and files written before this class
        hold them; absent names keep their defaults."""
        names = [name for name in cls.__dataclass_fields__ if prefix + name in data]
        return cls(**{name: data[prefix + name] for name in names})
