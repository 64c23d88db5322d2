"""Placement policies: each a pure function of one request and the same instance-state records, returning the index
of the instance to send it to. Nothing here does I/O or keeps state between calls (round robin is handed its turn),
so a simulator can run the very code the router runs.

- `round_robin`: the turn's instance (the baseline).
- `least_load`: the fewest requests queued and running.
- `prefix_aware` (SGLang's cache-aware routing, in our own words): while the load is balanced, the instance holding
  the longest cached prefix of the prompt if it covers more than `cache_threshold` of it, else the instance with the
  least cached (the most room to cache this prompt); once the load is imbalanced — the busiest instance has more than
  `balance_abs` requests over the idlest and more than `balance_rel` times its load — the least loaded.
- `length_aware` (TetriInfer, Aladdin): the instance with the least predicted decode work still to do (the predicted
  output tokens its requests have left, `LengthModel`), ties by predicted KV tokens, then load.

With `PolicyConfig.kv_room`, every policy but round robin chooses among the instances with KV room for the request
(`with_kv_room`), when any has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceState:
    """What placement knows of one instance: from its /metrics (`waiting`, `running`) and from the router's own
    bookkeeping of what it sent there (`in_flight`, the prompt blocks it sent, predicted work left)."""

    url: str
    waiting: int = 0  # queued on the instance, as its last /metrics scrape said
    running: int = 0
    in_flight: int = 0  # requests the router has open there now
    cached_blocks: Set[bytes] = frozenset()  # prefix-hash chain entries of prompts sent there (likely cached): a set,
    # or a live view of the router's record (read during one decision, never copied: it holds up to 64k entries)
    predicted_decode_tokens: float = 0.0  # predicted output tokens its in-flight requests have left
    predicted_kv_tokens: float = 0.0  # predicted KV (prompt + output) of its in-flight requests
    # KV tokens free on it: its last scrape's count less the predicted KV of the requests sent there since
    # (None: the instance does not say)
    free_kv_tokens: float | None = None

    @property
    def load(self) -> int:
        """Requests on the instance: the router's count, or the scrape's when it is higher (other clients, or
        requests the scrape saw that the router has already forgotten)."""
        return max(self.in_flight, self.waiting + self.running)

    def cached_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks this instance holds (a chain: the first miss ends it)."""
        n = 0
        for h in block_hashes:
            if h not in self.cached_blocks:
                break
            n += 1
        return n


@dataclass(frozen=True)
class RouteRequest:
    """One request as placement sees it."""

    prompt_len: int
    block_hashes: tuple[bytes, ...] = ()  # the prompt's prefix-hash chain (`PoolConfig.block_tokens` per block)
    predicted_output: float = 0.0


@dataclass(frozen=True)
class PolicyConfig:
    cache_threshold: float = 0.5  # prefix_aware: cached share of the prompt above which the cache wins
    balance_abs: int = 4  # prefix_aware: imbalanced when max load - min load exceeds this ...
    balance_rel: float = 1.5  # ... and max load exceeds this times min load
    # every policy but round robin chooses among the instances with KV room for the request (`with_kv_room`) when
    # any has: off by default, since it trades prefix hits for fewer waits for blocks (docs/results.md)
    kv_room: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError(f"need balance_abs >= 0 and balance_rel >= 1, got {self.balance_abs}, {self.balance_rel}")


Policy = Callable[[RouteRequest, Sequence[InstanceState], PolicyConfig, int], int]


def _argmin(instances: Sequence[InstanceState], key: Callable[[InstanceState], tuple]) -> int:
    return min(range(len(instances)), key=lambda i: (*key(instances[i]), i))


def round_robin(req: RouteRequest, instances: Sequence[InstanceState], cfg: PolicyConfig, turn: int) -> int:
    return turn % len(instances)


def least_load(req: RouteRequest, instances: Sequence[InstanceState], cfg: PolicyConfig, turn: int) -> int:
    return _argmin(instances, lambda s: (s.load, s.predicted_kv_tokens))


def prefix_aware(req: RouteRequest, instances: Sequence[InstanceState], cfg: PolicyConfig, turn: int) -> int:
    loads = [s.load for s in instances]
    lo, hi = min(loads), max(loads)
    if hi - lo > cfg.balance_abs and hi > cfg.balance_rel * lo:
        return least_load(req, instances, cfg, turn)
    matched = [s.cached_prefix(req.block_hashes) for s in instances]
    best = max(range(len(instances)), key=lambda i: (matched[i], -loads[i], -i))
    if req.block_hashes and matched[best] / len(req.block_hashes) > cfg.cache_threshold:
        return best
    return _argmin(instances, lambda s: (len(s.cached_blocks), s.load))


def length_aware(req: RouteRequest, instances: Sequence[InstanceState], cfg: PolicyConfig, turn: int) -> int:
    return _argmin(instances, lambda s: (s.predicted_decode_tokens, s.predicted_kv_tokens, s.load))


def with_kv_room(req: RouteRequest, instances: Sequence[InstanceState]) -> list[int]:
    """The instances with room in their KV for the request's prompt and predicted output (one that does not say
    counts as having room); all of them when none has: placement then chooses among these, so that a request is
    not sent where it would wait for blocks, or preempt others, while another instance has them free."""
    need = req.prompt_len + req.predicted_output
    room = [i for i, s in enumerate(instances) if s.free_kv_tokens is None or s.free_kv_tokens >= need]
    return room or list(range(len(instances)))


POLICIES: dict[str, Policy] = {"round_robin": round_robin, "least_load": least_load, "prefix_aware": prefix_aware,
                               "length_aware": length_aware}
