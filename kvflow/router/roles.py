"""Re-balancing the P/D pools: an instance moves between the prefill and the decode pool when the measured mix calls
for it (TetriInfer's flip; Splitwise's machines moving between its prompt and token pools).

The signal is what the pools are for, read from the requests that went through both (`observe`): the prefill pool
answers for TTFT, the decode pool for TPOT. Over the last `window_s` seconds, each pool's pressure is its 90th
percentile over its SLO. When one pool's pressure is above 1 (its SLO missed for more than a tenth of the requests)
and above `margin` times the other's, the other pool should give it an instance; after `after` decisions in a row
saying the same, `RoleBalancer.decide` names the instance to move — the donor pool's least busy, never its last — and
the pool drains it into its new role (`InstancePool.set_role`). The window then starts afresh, so the next move is
judged on what the last one did.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvflow.router.pool import InstancePool


@dataclass(frozen=True)
class BalanceConfig:
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.2
    window_s: float = 30.0  # the requests that finished over this past window
    interval_s: float = 10.0  # a decision every this many seconds
    after: int = 3  # decisions in a row asking for the same move before it is made
    margin: float = 1.25  # how much more pressed the short pool must be than the donor
    min_requests: int = 8  # fewer finished requests in the window: no decision

    def __post_init__(self) -> None:
        for name in ("ttft_slo_s", "tpot_slo_s", "window_s", "interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.after < 1 or self.margin < 1.0 or self.min_requests < 1:
            raise ValueError(f"need after >= 1, margin >= 1 and min_requests >= 1, got {self.after}, {self.margin}, "
                             f"{self.min_requests}")


def _p90(values) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(0.9 * len(v)))]


class RoleBalancer:
    """See the module docstring. `clock`: seconds, monotonic (tests pass their own)."""

    def __init__(self, cfg: BalanceConfig, pool: InstancePool, clock=time.monotonic) -> None:
        self.cfg, self.pool, self.clock = cfg, pool, clock
        self.seen: deque[tuple[float, float, float]] = deque()  # (finished at, TTFT, TPOT) of P/D requests
        self._want: tuple[str, str] | None = None
        self._streak = 0
        self.moves: list[tuple[str, str]] = []  # (instance, new role), in order

    def observe(self, ttft_s: float, tpot_s: float) -> None:
        """A request that ran its prompt on the prefill pool and its decode on the decode pool finished."""
        self.seen.append((self.clock(), ttft_s, tpot_s))

    def pressures(self) -> tuple[float, float] | None:
        """(prefill pool's, decode pool's): p90 TTFT / its SLO, p90 TPOT / its SLO; None with too few requests."""
        now = self.clock()
        while self.seen and now - self.seen[0][0] > self.cfg.window_s:
            self.seen.popleft()
        if len(self.seen) < self.cfg.min_requests:
            return None
        return (_p90(t for _, t, _ in self.seen) / self.cfg.ttft_slo_s,
                _p90(t for _, _, t in self.seen) / self.cfg.tpot_slo_s)

    def decide(self) -> tuple[str, str] | None:
        """One decision: the (instance URL, new role) to move now, after which the pool drains it; or None."""
        p = self.pressures()
        want = None
        if p is not None:
            prefill, decode = p
            if prefill > 1.0 and prefill > self.cfg.margin * decode:
                want = ("decode", "prefill")
            elif decode > 1.0 and decode > self.cfg.margin * prefill:
                want = ("prefill", "decode")
        if want is None or len(self.pool.serving(want[0])) < 2:  # a pool keeps its last instance
            self._want, self._streak = None, 0
            return None
        self._streak = self._streak + 1 if want == self._want else 1
        self._want = want
        if self._streak < self.cfg.after:
            return None
        donor = min(self.pool.serving(want[0]), key=lambda i: (len(i.flights), i.url))
        self.pool.set_role(donor.url, want[1])
        self.moves.append((donor.url, want[1]))
        self._want, self._streak = None, 0
        self.seen.clear()
        return donor.url, want[1]
