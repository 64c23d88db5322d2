"""Scaling the router's own instances (`kvflow.router.scaling`): the load meter's window, the simulated cluster's
answer (the fewest instances meeting the SLOs, growing with the rate), and the autoscaler applying answers to real
`kvflow serve` processes: one started and joined, one retired (out of the pool, drained, exited) only after answers
in a row."""

from __future__ import annotations

import random

import pytest

from kvflow.perf import AnalyticPerfModel, machine, model_shape
from kvflow.router.config import RouterConfig, ScalingConfig
from kvflow.router.fleet import FleetConfig, LocalFleet
from kvflow.router.scaling import LoadMeter, instance_config, instances_needed
from router_helpers import BLOCK, RouterThread, complete, instance_args, tiny_long_ckpt, until  # noqa: F401

PERF = AnalyticPerfModel(model_shape("smollm2-135m"), machine("1xCPU"))
PROMPTS = [random.Random(i).randint(50, 400) for i in range(100)]
OUTPUTS = [random.Random(i + 7).randint(20, 200) for i in range(100)]
# SLOs this analytic CPU model can meet at low load (its prefill of a few hundred tokens takes seconds)
SCALING = ScalingConfig(1, 8, ttft_slo_s=6.0, tpot_slo_s=0.5, trial_requests=120)


def test_the_meter_counts_only_its_window():
    now = [0.0]
    m = LoadMeter(10.0, clock=lambda: now[0])
    for t in range(20):  # one arrival a second for 20 s; the odd ones finish
        now[0] = float(t)
        m.arrived()
        if t % 2:
            m.finished(100 + t, t)
    now[0] = 19.5
    assert m.rate() == pytest.approx(1.0)  # the arrivals at 10..19 s
    assert m.mix() == ([111, 113, 115, 117, 119], [11, 13, 15, 17, 19])
    now[0] = 100.0
    assert m.rate() == 0 and m.mix() == ([], [])


def test_more_load_needs_more_instances_and_nothing_needs_the_minimum():
    inst = instance_config(2048)
    router = RouterConfig(policy="least_load")
    answers = [instances_needed(rate, PROMPTS, OUTPUTS, SCALING, PERF, inst, router) for rate in (0.05, 0.3, 1.0, 4.0)]
    assert answers == sorted(answers) and answers[0] == 1 and answers[-1] > answers[1] > answers[0]
    assert answers[-1] <= SCALING.max_instances
    assert instances_needed(0.0, PROMPTS, OUTPUTS, SCALING, PERF, inst, router) == 1  # nothing arrives
    assert instances_needed(1.0, PROMPTS, [], SCALING, PERF, inst, router) == 1  # nothing finished yet: no mix
    # instances the router does not scale carry their share: fewer of its own are needed
    assert instances_needed(1.0, PROMPTS, OUTPUTS, SCALING, PERF, inst, router, fixed=2) == max(1, answers[2] - 2)



def test_the_autoscaler_starts_an_instance_and_retires_it_after_answers_in_a_row(tiny_long_ckpt):
    fleet = LocalFleet(FleetConfig(1, instance_args(tiny_long_ckpt)))
    urls = fleet.start()
    try:
        cfg = RouterConfig(instances=tuple(urls), policy="round_robin", block_tokens=BLOCK, health_interval_s=0.2)
        router = RouterThread(cfg, tiny_long_ckpt, fleet=fleet, wait_s=180)
        router.backend.scale(ScalingConfig(1, 2, interval_s=3600, scale_down_after=2), PERF, instance_config(1024))
    except BaseException:
        fleet.close()
        raise
    prompt = random.Random(5).choices(range(5, 96), k=24)
    with router:
        scaler = router.backend.autoscaler
        ref = complete(router.url, prompt, 10)["token_ids"]
        assert router.backend.meter.rate() > 0 and router.backend.meter.mix() == ([24], [10])  # the router measured it
        assert router.on_loop(lambda: scaler.step(2)) == 2  # more: at once
        new = fleet.active[1]
        until(lambda: router.instances().get(new.url, {}).get("healthy", False))
        assert [complete(router.url, prompt, 10)["token_ids"] for _ in range(2)] == [ref, ref]
        assert router.routed()[new.url] == 1  # round robin: the new instance served one of them
        assert router.on_loop(lambda: scaler.step(1)) == 2  # one answer for fewer: kept
        assert router.on_loop(lambda: scaler.step(2)) == 2  # (the count starts again)
        assert router.on_loop(lambda: scaler.step(1)) == 2
        assert router.on_loop(lambda: scaler.step(1)) == 1  # the second in a row: the newest retired
        assert new.url not in router.instances() and new.retired
        assert new.proc.wait(60) == 0  # SIGTERM: it drained and exited cleanly
        assert complete(router.url, prompt, 10)["token_ids"] == ref  # the first one serves on
        assert [d[2] for d in scaler.decisions] == [2, 2, 2, 2, 1]
    assert all(i.proc.poll() is not None for i in fleet.instances)


def test_the_router_cli_checks_its_scaling_flags(capsys):
    from kvflow.cli.main import main

    for args, message in ((["--autoscale", "3"], "MIN:MAX"), (["--autoscale", "1:2"], "--scale-profile"),
                          (["--autoscale", "3:2", "--scale-profile", __file__], "min_instances"),
                          (["--autoscale", "1:2", "--scale-profile", __file__], "not a `kvflow profile` file")):
        assert main(["router", "--launch", "1", *args]) == 2  # before any instance is started
        assert message in capsys.readouterr().err
    for args, message in ((["--launch-pd", "1"], "P:D"), (["--launch-pd", "0:2"], "each >= 1"),
                          (["--launcher", "ray"], "give one of them"), (["--rebalance"], "P/D pools"),
                          (["--launch", "1", "--launch-pd", "1:1", "--autoscale", "2:3", "--scale-profile", __file__],
                           "not a `kvflow profile` file")):
        assert main(["router", *args]) == 2
        assert message in capsys.readouterr().err


def test_pd_pools_are_sized_per_role_in_the_simulated_cluster():
    """P/D pools: the fewest instances in all that meet the SLOs with their best split, growing with the load."""
    inst = instance_config(2048, block_size=16)
    router = RouterConfig(policy="least_load", block_tokens=16)
    cfg = ScalingConfig(2, 6, ttft_slo_s=6.0, tpot_slo_s=0.5, trial_requests=80)
    answers = [instances_needed(rate, PROMPTS, OUTPUTS, cfg, PERF, inst, router, pd=True) for rate in (0.05, 1.0)]
    assert answers[0] == (1, 1) and all(p >= 1 and d >= 1 for p, d in answers)
    assert sum(answers[1]) > sum(answers[0])
    assert instances_needed(0.0, PROMPTS, OUTPUTS, cfg, PERF, inst, router, pd=True) == (1, 1)  # nothing arrives


def test_the_autoscaler_sizes_pd_pools_per_role(tiny_long_ckpt):
    fleet = LocalFleet(FleetConfig(2, instance_args(tiny_long_ckpt)))
    first, second = fleet.start()
    try:
        cfg = RouterConfig(prefill=(first,), decode=(second,), block_tokens=BLOCK, health_interval_s=0.2)
        router = RouterThread(cfg, tiny_long_ckpt, fleet=fleet, wait_s=180)
        router.backend.scale(ScalingConfig(2, 3, interval_s=3600, scale_down_after=2), PERF, instance_config(1024))
    except BaseException:
        fleet.close()
        raise
    prompt = random.Random(6).choices(range(5, 96), k=3 * BLOCK + 1)
    with router:
        scaler = router.backend.autoscaler
        assert scaler.pd and scaler.trial()[-1] is True  # the trials answer per role
        ref = complete(router.url, prompt, 6)["token_ids"]
        assert router.on_loop(lambda: scaler.step((1, 2))) == 3  # one more decode instance, at once
        new = fleet.active[2]
        until(lambda: router.instances().get(new.url, {}).get("healthy", False))
        assert router.instances()[new.url]["role"] == "decode"
        assert router.on_loop(lambda: scaler.step((1, 1))) == 3  # one answer for fewer: kept
        assert router.on_loop(lambda: scaler.step((1, 1))) == 2  # the second in a row: the newest decoder retired
        assert new.url not in router.instances() and new.proc.wait(60) == 0
        assert complete(router.url, prompt, 6)["token_ids"] == ref
        assert {i["role"] for i in router.instances().values()} == {"prefill", "decode"}
    assert all(i.proc.poll() is not None for i in fleet.instances)
