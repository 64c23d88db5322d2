"""The simulated cluster (`kvflow.router.simulated`): the router's own pool and policies placing requests over
simulated instances (the simulator's engine model, real schedulers and prefix caches)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest

from kvflow.router.config import RouterConfig
from kvflow.router.length import LengthModel
from kvflow.router.simulated import RoutedSimulator, imbalance, instances_config, simulate_cluster
from kvflow.sched.scheduler import SchedulerConfig
from kvflow.simulator import Layout, PipelineGroup, SimConfig
from kvflow.simulator.workload import Workload

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "simulator"))
from sim_helpers import PacedPerf  # noqa: E402  (prefill time grows with the tokens computed: cache hits pay less)

ONE = SimConfig(Layout(PipelineGroup(1, 8)), policy="continuous", block_size=16, kv_blocks=4096,
                scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, prefill_chunk_size=1024))


def shared_prefix(prefixes: int, uses: int, prefix_len: int = 256, seed: int = 0) -> tuple[Workload, list[int]]:
    """`prefixes` x `uses` requests, each a shared prefix + 16 tokens of its own, shuffled, one every 0.5 s."""
    rng = random.Random(seed)
    heads = [[rng.randrange(100, 1000) for _ in range(prefix_len)] for _ in range(prefixes)]
    order = [k for k in range(prefixes) for _ in range(uses)]
    rng.shuffle(order)
    prompts = tuple(tuple(heads[k] + [rng.randrange(100, 1000) for _ in range(16)]) for k in order)
    n = len(prompts)
    return Workload(np.arange(n) * 0.5, np.array([len(p) for p in prompts]), np.full(n, 4), prompts), order


def test_prefix_aware_keeps_each_prefix_on_one_instance_and_hits_its_cache():
    w, order = shared_prefix(6, 4)
    res = {}
    for policy in ("round_robin", "prefix_aware"):
        sim = RoutedSimulator(instances_config(4, ONE), PacedPerf(), w, RouterConfig(policy=policy, block_tokens=16),
                              LengthModel.load())
        res[policy] = sim.run_cluster()
        placed = {}
        for k, inst in zip(order, res[policy].placed):
            placed.setdefault(k, set()).add(inst)
        if policy == "prefix_aware":
            assert all(len(v) == 1 for v in placed.values())  # each prefix's requests on one instance
        else:
            assert res[policy].routed == [6, 6, 6, 6]
        assert not any(inst.flights for inst in sim.pool.instances.values())  # every flight closed
        assert sum(res[policy].decode_tokens) == 4 * len(order)
        assert (res[policy].result.completions == 1).all()
    # hits: the later uses of a prefix prefill 16 tokens, not 272
    assert np.median(res["prefix_aware"].result.ttft) < 0.5 * np.median(res["round_robin"].result.ttft)


def test_length_aware_spreads_predicted_work_by_the_length_model():
    # two kinds of prompts whose buckets predict very different outputs; outputs as predicted
    model = LengthModel.fit("t", [(40, 200)] * 30 + [(300, 10)] * 30)
    rng = np.random.default_rng(1)
    long = rng.random(40) < 0.25
    prompt = np.where(long, 40, 300)
    out = np.where(long, 200, 10)
    w = Workload(np.zeros(40), prompt.astype(np.int64), out.astype(np.int64))
    got = {p: simulate_cluster(4, ONE, PacedPerf(), w, RouterConfig(policy=p), model) for p in ("least_load", "length_aware")}
    assert imbalance(got["length_aware"].decode_tokens) < imbalance(got["least_load"].decode_tokens)
    assert imbalance(got["length_aware"].decode_tokens) < 1.1  # greedy in arrival order: near even


def test_hop_delays_the_instance_but_times_count_from_the_router():
    w, _ = shared_prefix(2, 2)
    base = simulate_cluster(2, ONE, PacedPerf(), w, RouterConfig(policy="round_robin"))
    hop = simulate_cluster(2, ONE, PacedPerf(), w, RouterConfig(policy="round_robin"), hop_s=0.25)
    np.testing.assert_allclose(hop.result.arrival, w.arrival)
    np.testing.assert_allclose(hop.result.ttft, base.result.ttft + 0.25)
    with pytest.raises(ValueError, match="single-stage"):
        RoutedSimulator(ONE, PacedPerf(), w, RouterConfig(), LengthModel.load())


def test_pd_pools_in_the_simulated_cluster_hand_each_prompt_over_with_its_kv():
    """P/D pools: every prompt runs on the prefill instance (its first token there), then on a decode instance,
    whose admission finds the prompt's full blocks cached (pulled) and computes only the rest."""
    n = 12
    rng = random.Random(3)
    prompts = tuple(tuple(rng.randrange(100, 1000) for _ in range(100)) for _ in range(n))
    w = Workload(np.arange(n) * 0.2, np.full(n, 100), np.full(n, 8), prompts)
    router = RouterConfig(policy="least_load", block_tokens=16)
    sim = RoutedSimulator(instances_config(3, ONE), PacedPerf(), w, router, LengthModel.load(),
                          roles=("prefill", "decode", "decode"))
    res = sim.run_cluster()
    assert (res.result.completions == 1).all() and not sim.prefilling and not sim.decoding
    assert res.routed[0] == n and res.routed[1] + res.routed[2] == n  # every request on both pools
    assert res.decode_tokens == [n * 1, *res.decode_tokens[1:]] and sum(res.decode_tokens) == 8 * n
    hits = sum(sim.prompt[k].kv_manager.stats.hits for k in (1, 2))
    assert hits == n * 96  # each prompt's 6 full blocks came with it: only its last 4 tokens + 1 computed there
    assert not any(inst.flights for inst in sim.pool.instances.values())
    mixed = simulate_cluster(3, ONE, PacedPerf(), w, router)
    assert (mixed.result.completions == 1).all() and sum(mixed.decode_tokens) == 8 * n
    # the first token comes from the prefill instance: no later than in the mixed pool at this light load
    assert np.median(res.result.ttft) <= 1.05 * np.median(mixed.result.ttft)
    with pytest.raises(ValueError, match="roles"):
        RoutedSimulator(instances_config(3, ONE), PacedPerf(), w, router, LengthModel.load(), roles=("prefill",))
