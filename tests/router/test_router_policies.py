"""Placement policies (pure functions: exact choices), the output-length model and the router's config."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvflow.api.metrics import APIMetrics
from kvflow.api.protocol import CompletionRequest

from kvflow.kv.prefix_hash import extend_hashes
from kvflow.router.backend import ROUTER_ONLY, request_body
from kvflow.router.config import RouterConfig
from kvflow.router.length import DATA, LengthModel, bucket
from kvflow.router.policies import (InstanceState, PolicyConfig, RouteRequest, least_load, length_aware,
                                    prefix_aware, round_robin, with_kv_room)
from kvflow.router.pool import InstancePool, ModelInfo, scrape
from kvflow.sched.sampling import SamplingParams
from kvflow.serving.backend import BackendStats

CFG = PolicyConfig(cache_threshold=0.5, balance_abs=4, balance_rel=1.5)


def hashes(tokens: list[int], block: int = 4) -> tuple[bytes, ...]:
    return tuple(extend_hashes([], tokens, len(tokens) // block, block))


SHARED = list(range(100, 116))  # 4 blocks of 4
PROMPT = SHARED + [1, 2, 3, 4]  # 5 blocks: the first 4 shared


def test_round_robin_takes_turns():
    insts = [InstanceState(f"u{i}", in_flight=9 * i) for i in range(3)]
    assert [round_robin(RouteRequest(8), insts, CFG, t) for t in range(5)] == [0, 1, 2, 0, 1]


def test_least_load_counts_the_router_and_the_scrape():
    insts = [InstanceState("a", in_flight=3), InstanceState("b", waiting=1, running=1), InstanceState("c", in_flight=2)]
    assert least_load(RouteRequest(8), insts, CFG, 0) == 1  # b: 2 by its scrape
    assert InstanceState("x", waiting=5, in_flight=2).load == 5 and InstanceState("x", waiting=1, in_flight=2).load == 2
    # a tie goes to the smaller predicted KV, then the first
    tie = [InstanceState("a", in_flight=1, predicted_kv_tokens=90), InstanceState("b", in_flight=1, predicted_kv_tokens=10)]
    assert least_load(RouteRequest(8), tie, CFG, 0) == 1


def test_prefix_aware_follows_the_longest_cached_prefix():
    req = RouteRequest(len(PROMPT), hashes(PROMPT))
    holder = InstanceState("holder", in_flight=2, cached_blocks=frozenset(hashes(SHARED)))
    partial = InstanceState("partial", in_flight=0, cached_blocks=frozenset(hashes(SHARED)[:2]))
    empty = InstanceState("empty", in_flight=0)
    assert holder.cached_prefix(req.block_hashes) == 4 and partial.cached_prefix(req.block_hashes) == 2
    assert prefix_aware(req, [empty, partial, holder], CFG, 0) == 2  # 4/5 cached > 0.5, though busier
    # a match at or under the threshold: the instance with the least cached (most room)
    assert prefix_aware(req, [holder, partial, empty], PolicyConfig(cache_threshold=0.8), 0) == 2
    # a chain: a cached later block without its parents does not count
    gap = InstanceState("gap", cached_blocks=frozenset(hashes(PROMPT)[1:]))
    assert gap.cached_prefix(req.block_hashes) == 0


def test_prefix_aware_falls_back_to_least_load_when_imbalanced():
    req = RouteRequest(len(PROMPT), hashes(PROMPT))
    holder = InstanceState("holder", in_flight=7, cached_blocks=frozenset(hashes(SHARED)))
    idle = InstanceState("idle", in_flight=2)
    assert prefix_aware(req, [holder, idle], CFG, 0) == 1  # 7 - 2 > 4 and 7 > 1.5 * 2
    assert prefix_aware(req, [InstanceState("holder", in_flight=6, cached_blocks=holder.cached_blocks), idle], CFG, 0) == 0
    # relative bound: 20 vs 15 exceeds balance_abs but not 1.5x
    assert prefix_aware(req, [InstanceState("h", in_flight=20, cached_blocks=holder.cached_blocks),
                              InstanceState("i", in_flight=15)], CFG, 0) == 0


def test_length_aware_balances_predicted_decode_work():
    insts = [InstanceState("a", in_flight=1, predicted_decode_tokens=400.0, predicted_kv_tokens=900.0),
             InstanceState("b", in_flight=5, predicted_decode_tokens=60.0, predicted_kv_tokens=5000.0),
             InstanceState("c", in_flight=2, predicted_decode_tokens=60.0, predicted_kv_tokens=700.0)]
    assert length_aware(RouteRequest(100, predicted_output=50.0), insts, CFG, 0) == 2  # b and c tie on decode; c less KV
    assert least_load(RouteRequest(100), insts, CFG, 0) == 0  # where least-load disagrees


def test_policy_config_is_validated():
    with pytest.raises(ValueError, match="cache_threshold"):
        PolicyConfig(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_rel"):
        PolicyConfig(balance_rel=0.5)


def test_length_model_fit_and_predict():
    rows = [(300, 10)] * 30 + [(300, 110)] * 30 + [(1000, 500)] * 25 + [(5, 7)] * 3  # the last bucket is too small
    m = LengthModel.fit("t", rows)
    assert sorted(m.buckets) == [bucket(300), bucket(1000)] and bucket(300) == 8 and bucket(1000) == 9
    assert m.predict(300) == 60.0 and m.quantile(300, 0.5) == 110 and m.quantile(300, 0.9) == 110
    assert m.predict(1000) == 500.0
    assert m.predict(1000, max_tokens=64) == 64.0 and m.predict(1000, max_tokens=4096) == 500.0  # capped by max_tokens
    assert m.predict(5) == m.overall["mean"] == round((30 * 10 + 30 * 110 + 25 * 500 + 3 * 7) / 88, 2)


def test_shipped_length_models_load_and_differ_by_service():
    models = json.loads(DATA.read_text())["models"]
    assert set(models) == {"code", "conv", "all"}
    conv, code = LengthModel.load("conv"), LengthModel.load("code")
    assert conv.predict(1000) > 5 * code.predict(1000)  # conversation answers are far longer than code completions
    with pytest.raises(ValueError, match="no length model"):
        LengthModel.load("chat")


def test_router_config(tmp_path):
    cfg = RouterConfig(instances=("http://127.0.0.1:8001/", "http://127.0.0.1:8001", "http://h:9"))
    assert cfg.instances == ("http://127.0.0.1:8001", "http://h:9")
    with pytest.raises(ValueError, match="base URL"):
        RouterConfig(instances=("127.0.0.1:8001",))
    with pytest.raises(ValueError, match="unknown policy"):
        RouterConfig(policy="random")
    f = tmp_path / "router.yaml"
    f.write_text("instances: [http://a:1, http://b:2]\npolicy: least_load\nplacement: {cache_threshold: 0.3}\n")
    cfg = RouterConfig.from_file(f, policy="round_robin", block_tokens=None)
    assert cfg.instances == ("http://a:1", "http://b:2") and cfg.policy == "round_robin"
    assert cfg.placement.cache_threshold == 0.3 and cfg.block_tokens == RouterConfig().block_tokens
    f.write_text("instances: [http://a:1]\npolcy: x\n")
    with pytest.raises(ValueError, match="unknown router setting"):
        RouterConfig.from_file(f)


def test_request_body_forwards_every_sampling_field():
    """Every `SamplingParams` field reaches the instance (a field added to sampling and the API is forwarded with no
    change here), and a continuation asks only for what is left."""
    params = SamplingParams(max_tokens=50, temperature=0.7, top_k=5, top_p=0.9, seed=3, stop=("x",),
                            stop_token_ids=(9,), min_tokens=10, ignore_eos=True)
    body = request_body("m", [1, 2, 3, 4], params, generated=4)
    sent = {f.name for f in dataclasses.fields(SamplingParams)} - set(ROUTER_ONLY)
    assert sent <= set(body) and sent <= set(CompletionRequest.model_fields)
    assert body["max_tokens"] == 46 and body["min_tokens"] == 6 and body["prompt"] == [1, 2, 3, 4]
    assert body["stop"] == ["x"] and body["stop_token_ids"] == [9] and body["seed"] == 3 and body["top_k"] == 5
    CompletionRequest.model_validate(body)  # what the instance parses (strict): accepted as is
    assert request_body("m", [1], params, generated=12)["min_tokens"] == 0


def test_health_and_queue_lengths_are_read_from_an_instances_metrics():
    """What the pool's health check learns from an instance's /metrics, read from the text the API itself renders."""
    text = APIMetrics().render(BackendStats(waiting_requests=3, running_requests=2), healthy=True).decode()
    assert scrape(text) == {"kvflow_backend_healthy": 1.0, "kvflow_num_requests_waiting": 3.0,
                            "kvflow_num_requests_running": 2.0}
    assert scrape(APIMetrics().render(BackendStats(), healthy=False).decode())["kvflow_backend_healthy"] == 0.0
    text = APIMetrics().render(BackendStats(kv_free_tokens=300, kv_capacity_tokens=1200), healthy=True).decode()
    assert scrape(text)["kvflow_kv_free_tokens"] == 300.0 and "kvflow_kv_cache_usage 0.75" in text
    assert scrape("") == {}  # not a kvflow instance's page: the check asks /health instead


def test_pool_route_extends_a_known_chain_and_caps_the_prediction():
    model = LengthModel.fit("t", [(20, 100)] * 30)
    pool = InstancePool(RouterConfig(block_tokens=4), ModelInfo("m", 64), None, model)
    whole = pool.route(PROMPT + [5, 6, 7, 8, 9])
    assert whole.block_hashes == hashes(PROMPT + [5, 6, 7, 8], 4) and whole.prompt_len == 25
    assert pool.route(PROMPT + [5, 6, 7, 8, 9], None, hashes(PROMPT, 4)) == whole  # extended, not recomputed
    assert pool.route(PROMPT, 40).predicted_output == 40.0 and pool.route(PROMPT).predicted_output == 100.0


def test_placement_skips_instances_without_kv_room_while_another_has_it():
    need = RouteRequest(100, (), 50.0)  # 150 KV tokens
    insts = [InstanceState("a", free_kv_tokens=120), InstanceState("b"), InstanceState("c", free_kv_tokens=150)]
    assert with_kv_room(need, insts) == [1, 2]  # b does not say: room assumed
    assert with_kv_room(need, [insts[0], InstanceState("d", free_kv_tokens=10)]) == [0, 1]  # none has: all
    # the pool: the instance holding the prompt's prefix is full, so prefix-aware placement goes elsewhere
    model = LengthModel.fit("t", [(20, 8)] * 30)
    for policy, want in (("prefix_aware", "http://b:1"), ("round_robin", "http://a:1")):
        pool = InstancePool(RouterConfig(block_tokens=4, policy=policy, placement=PolicyConfig(kv_room=True)),
                            ModelInfo("m", 64), None, model)
        for url in ("http://a:1", "http://b:1"):
            pool.add_unchecked(url)
            pool.instances[url].healthy = True
        a, b = pool.instances["http://a:1"], pool.instances["http://b:1"]
        pool.remember(a, hashes(PROMPT, 4))
        a.scraped(0, 1, free_kv_tokens=24.0)
        b.scraped(0, 0, free_kv_tokens=1000.0)
        assert pool.choose(pool.route(PROMPT, 8)).url == want  # 20 + 8 tokens do not fit in a's 24
        if policy == "round_robin":  # the baseline stays blind to it
            continue
        a.scraped(0, 1, free_kv_tokens=40.0)  # room again: the cache wins
        assert pool.choose(pool.route(PROMPT, 8)).url == "http://a:1"
        flight = pool.open(a, pool.route(PROMPT, 8))  # what the router sent since the scrape counts against it
        assert a.state().free_kv_tokens == 40.0 - 28.0
        pool.close(a, flight)
        a.scraped(0, 1, free_kv_tokens=24.0)
        pool.config = dataclasses.replace(pool.config, placement=PolicyConfig())  # off (the default): the cache wins
        assert pool.choose(pool.route(PROMPT, 8)).url == "http://a:1"
