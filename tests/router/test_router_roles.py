"""Instance roles in the router's pool: placement by a phase's roles, role changes that drain first, and the
re-balancing of the P/D pools from measured TTFT and TPOT (`kvflow.router.roles`)."""

from __future__ import annotations

import pytest

from kvflow.router.config import RouterConfig
from kvflow.router.length import LengthModel
from kvflow.router.pool import InstancePool, ModelInfo
from kvflow.router.roles import BalanceConfig, RoleBalancer

PROMPT = list(range(5, 25))


def pool_of(**roles: str) -> InstancePool:
    pool = InstancePool(RouterConfig(block_tokens=4, policy="least_load"), ModelInfo("m", 64), None,
                        LengthModel.fit("t", [(20, 8)] * 30))
    for name, role in roles.items():
        pool.add_unchecked(f"http://{name}:1", role)
        pool.instances[f"http://{name}:1"].healthy = True
    return pool


def test_choose_keeps_to_the_phase_roles_and_falls_back_to_any():
    pool = pool_of(p="prefill", d="decode", m="mixed")
    route = pool.route(PROMPT, 8)
    assert pool.choose(route, roles=("prefill",)).url == "http://p:1"
    assert pool.choose(route, roles=("decode", "mixed")).url in ("http://d:1", "http://m:1")
    assert pool.choose(route, {"http://p:1"}, roles=("prefill",)).url != "http://p:1"  # none left in it: any role
    with pytest.raises(ValueError, match="role"):
        pool.add_unchecked("http://x:1", "boss")
    with pytest.raises(ValueError, match="one role"):
        RouterConfig(prefill=("http://a:1",), decode=("http://a:1",))
    assert RouterConfig(instances=("http://m:1",), prefill=("http://p:1",)).roles() == {
        "http://m:1": "mixed", "http://p:1": "prefill"}


def test_a_role_change_drains_first():
    pool = pool_of(a="prefill", b="decode")
    a = pool.instances["http://a:1"]
    route = pool.route(PROMPT, 8)
    flight = pool.open(a, route)
    pool.set_role(a.url, "decode")
    assert (a.role, a.next_role) == ("prefill", "decode")  # a request of its old role is still open there
    assert pool.serving("prefill") == [] and pool.serving("decode") == [pool.instances["http://b:1"]]
    assert pool.choose(route, roles=("prefill", "decode")).url == "http://b:1"  # no new request while draining
    pool.close(a, flight)
    assert (a.role, a.next_role) == ("decode", None)
    assert pool.set_role(a.url, "mixed").role == "mixed"  # nothing open: at once
    with pytest.raises(KeyError):
        pool.set_role("http://zz:1", "decode")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_balancer_moves_an_instance_to_the_pool_missing_its_slo_after_repeated_decisions():
    pool = pool_of(p1="prefill", d1="decode", d2="decode")
    clock = Clock()
    bal = RoleBalancer(BalanceConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, after=3, min_requests=4), pool, clock)
    assert bal.decide() is None  # nothing measured
    for _ in range(10):  # TTFT 3x its SLO, TPOT within: the prefill pool is short of an instance
        bal.observe(3.0, 0.05)
    assert [bal.decide(), bal.decide()] == [None, None]
    busy = pool.instances["http://d1:1"]
    pool.open(busy, pool.route(PROMPT, 8))
    assert bal.decide() == ("http://d2:1", "prefill")  # the third in a row: the donor's least busy instance
    assert pool.instances["http://d2:1"].role == "prefill" and bal.moves == [("http://d2:1", "prefill")]
    assert bal.pressures() is None  # measured afresh after a move
    for _ in range(10):  # TTFT still missed, but the decode pool keeps its last instance
        bal.observe(3.0, 0.05)
    assert [bal.decide() for _ in range(5)] == [None] * 5
    for _ in range(10):  # now TPOT is missed: the prefill pool (two again) gives one back
        bal.observe(0.5, 0.5)
    assert [bal.decide() for _ in range(3)] == [None, None, ("http://d2:1", "decode")]  # (ties: by URL)
    clock.t += 31.0  # the window forgets
    assert bal.pressures() is None


def test_balancer_leaves_balanced_or_met_pools_alone():
    pool = pool_of(p1="prefill", p2="prefill", d1="decode", d2="decode")
    bal = RoleBalancer(BalanceConfig(ttft_slo_s=1.0, tpot_slo_s=0.1, after=1, min_requests=4), pool, Clock())
    for _ in range(10):
        bal.observe(0.5, 0.05)  # both met
    assert bal.decide() is None
    for _ in range(10):
        bal.observe(2.0, 0.2)  # both missed alike (2x): no pool is the short one
    assert bal.decide() is None
    with pytest.raises(ValueError):
        BalanceConfig(margin=0.5)
