"""Performance models, memory feasibility, the simulated search and goodput search."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from kvflow.perf import AnalyticPerfModel, BatchShape, Profile, ProfiledPerfModel, Sample, machine, model_shape
from kvflow.perf.profiled import nonneg_lstsq
from kvflow.planner import SearchSpace, colocated_layouts, max_rate, recommend
from kvflow.planner.formulas import Infeasible
from kvflow.simulator import LengthDist, Layout, PipelineGroup, synthetic
from kvflow.slo import SLO


def test_model_shape_bytes():
    s = model_shape("opt-66b")
    assert s.kv_bytes_per_token == 2 * 64 * 9216 * 2
    assert s.params_per_layer == 12 * 9216 * 9216
    assert s.layers_per_stage(3) == 22
    with pytest.raises(ValueError):
        s.layers_per_stage(65)
    llama = model_shape("llama-2-70b")
    assert llama.kv_bytes_per_token_layer == 2 * 8 * 128 * 2


def test_analytic_model_scales_with_depth_and_batch():
    perf = AnalyticPerfModel(model_shape("opt-66b"), machine("2xA100-80GB"))
    assert perf.prompt_stage_time(8, 1000, 2) == pytest.approx(perf.prompt_stage_time(8, 1000, 4) * 2, rel=0.02)
    assert perf.prompt_stage_time(16, 1000, 4) > 1.9 * perf.prompt_stage_time(8, 1000, 4)  # compute-bound
    assert perf.token_stage_time(16, 1000, 4) < 1.5 * perf.token_stage_time(1, 1000, 4)  # memory-bound
    assert perf.token_stage_time(8, 2000, 4) > perf.token_stage_time(8, 1000, 4)


def test_memory_feasibility_matches_hand_count():
    perf = AnalyticPerfModel(model_shape("opt-66b"), machine("2xA100-80GB"))
    free = 160e9 * 0.9 - perf.stage_weight_bytes(2)
    per_req = 2024 * 32 * 2 * 9216 * 2
    assert perf.max_microbatch(2, 2024, 2) == int(free // (2 * per_req))
    space = SearchSpace(1000, 2024, 215.0, microbatches=(1, 2, 4, 8, 16, 32))
    lays = colocated_layouts(perf, 2, space)
    assert {lay.label() for lay in lays if lay.prompt.count == 1} == {
        f"(2p, {b}b)" for b in (1, 2, 4, 8, 16, 32) if b <= perf.max_microbatch(2, 2024, 2)}
    bloom = AnalyticPerfModel(model_shape("bloom-176b"), machine("4xA100-80GB"))
    assert colocated_layouts(bloom, 1, space) == []  # 352 GB of weights on 320 GB


def test_nonneg_lstsq_and_profiled_fit_recover_coefficients():
    x = np.array([[1, 0, 1], [1, 1, 0], [1, 2, 1], [1, 3, 5]], dtype=float)
    assert nonneg_lstsq(x, x @ np.array([0.5, 2.0, 0.0])) == pytest.approx([0.5, 2.0, 0.0])
    prompt = [Sample(b, s, 0.01 + 1e-5 * b * s + 2e-9 * b * s * s) for b in (1, 2, 4) for s in (16, 64, 256)]
    token = [Sample(b, c, 0.005 + 1e-4 * b + 1e-7 * b * c) for b in (1, 4, 8) for c in (32, 128, 512)]
    prof = Profile(model_shape("smollm2-135m"), "1xCPU", tuple(prompt), tuple(token), {})
    perf = ProfiledPerfModel(prof)
    assert perf.prompt_fit.coef == pytest.approx((0.01, 1e-5, 2e-9), rel=1e-6)
    assert perf.token_fit.max_rel_error < 1e-9
    assert perf.token_stage_time(4, 128, 1) == pytest.approx(0.005 + 4e-4 + 4 * 128e-7)
    # depth 2: the intercept and the weight term scaled by the last stage's parameters (15 layers
    # and the LM head), the attention term by its 15/30 layers
    sh = prof.shape
    w = (15 * sh.params_per_layer + sh.vocab * sh.hidden) / (30 * sh.params_per_layer + sh.vocab * sh.hidden)
    assert 0.6 < w < 0.61
    assert perf.token_stage_time(4, 128, 2) == pytest.approx(w * (0.005 + 4e-4) + 0.5 * 4 * 128e-7)
    # a mixed batch: one intercept, both variable parts
    mixed = BatchShape(prefill_seqs=1, prefill_tokens=16, prefill_attention=16 * 16, decode_seqs=4, decode_context=4 * 128)
    assert perf.step_time(mixed, 1) == pytest.approx(0.01 + 1e-5 * 16 + 2e-9 * 256 + 4e-4 + 4 * 128e-7)
    # each stage its own share: the last (LM head) is the step_time's stage, and the stages together
    # cost the whole model once (a token passes both)
    stages = [perf.stage_step_time(mixed, 2, k) for k in range(2)]
    assert stages[1] == pytest.approx(perf.step_time(mixed, 2)) and stages[0] < 0.7 * stages[1]
    assert sum(stages) == pytest.approx(perf.step_time(mixed, 1))


def test_worker_stages_do_not_pay_the_engines_host_side_work():
    # the fits are of engine steps (forward + the engine's scheduling, sampling, outputs); in worker
    # processes that host-side work is the controller's, inside the per-stage overhead
    token = [Sample(b, c, 0.030 + 1e-3 * b + 1e-7 * b * c) for b in (1, 2, 4) for c in (32, 128, 512)]
    prompt = [Sample(b, s, 0.040 + 1e-5 * b * s + 2e-9 * b * s * s) for b in (1, 2, 4) for s in (16, 64, 256)]
    prof = Profile(model_shape("smollm2-135m"), "1xCPU", tuple(prompt), tuple(token), {}, pass_overhead_s=0.005,
                   engine_host_s=0.004)
    engine, workers = ProfiledPerfModel(prof), ProfiledPerfModel(prof, executor=True)
    assert engine.token_stage_time(2, 128, 1) == pytest.approx(0.030 + 2e-3 + 2 * 128e-7)
    assert workers.token_stage_time(2, 128, 1) == pytest.approx(0.030 - 0.004 + 2e-3 + 2 * 128e-7 + 0.005)
    sh = prof.shape
    w = (15 * sh.params_per_layer + sh.vocab * sh.hidden) / (30 * sh.params_per_layer + sh.vocab * sh.hidden)
    assert engine.token_stage_time(2, 128, 2) == pytest.approx(w * (0.026 + 2e-3) + 0.5 * 2 * 128e-7 + 0.005)


def test_worker_overhead_is_one_round_trip_per_pass_plus_a_hop_per_further_stage():
    # the controller's round trip (growing with the batch) once per pass, on the last stage, whose
    # result ends the pass; each stage after the first adds its hop
    token = [Sample(b, c, 0.030 + 1e-3 * b + 1e-7 * b * c) for b in (1, 2, 4) for c in (32, 128, 512)]
    prompt = [Sample(b, s, 0.040 + 1e-5 * b * s + 2e-9 * b * s * s) for b in (1, 2, 4) for s in (16, 64, 256)]
    prof = Profile(model_shape("smollm2-135m"), "1xCPU", tuple(prompt), tuple(token), {}, pass_overhead_s=0.004,
                   seq_overhead_s=0.001, hop_overhead_s=0.002)
    engine, workers = ProfiledPerfModel(prof), ProfiledPerfModel(prof, executor=True)
    bare = ProfiledPerfModel(replace(prof, pass_overhead_s=0.0, seq_overhead_s=0.0, hop_overhead_s=0.0), executor=True)
    three = BatchShape(decode_seqs=3, decode_context=3 * 100)
    assert engine.step_time(three, 1) == pytest.approx(bare.step_time(three, 1))  # the engine pays none of it
    assert workers.step_time(three, 1) == pytest.approx(bare.step_time(three, 1) + 0.004 + 3 * 0.001)
    first, last = (workers.stage_step_time(three, 2, k) for k in range(2))
    assert first == pytest.approx(bare.stage_step_time(three, 2, 0))
    assert last == pytest.approx(bare.stage_step_time(three, 2, 1) + 0.002 + 0.004 + 3 * 0.001)
    assert workers.step_time(three, 2) == pytest.approx(last)  # the most loaded stage is the last
    assert workers.stage_step_time(three, 3, 1) == pytest.approx(bare.stage_step_time(three, 3, 1) + 0.002)
    # a pass that prefills pays the prompt pass's extra on top, on the last stage only
    prof = replace(prof, prompt_overhead_s=0.003)
    workers, engine = ProfiledPerfModel(prof, executor=True), ProfiledPerfModel(prof)
    mixed = BatchShape.of([(16, 16), (1, 40)])
    assert workers.step_time(mixed, 1) == pytest.approx(bare.step_time(mixed, 1) + 0.004 + 2 * 0.001 + 0.003)
    assert workers.step_time(three, 1) == pytest.approx(bare.step_time(three, 1) + 0.004 + 3 * 0.001)  # decode only: none
    assert workers.stage_step_time(mixed, 2, 0) == pytest.approx(bare.stage_step_time(mixed, 2, 0))
    assert workers.stage_step_time(mixed, 2, 1) == pytest.approx(bare.stage_step_time(mixed, 2, 1) + 0.002 + 0.004 + 2 * 0.001 + 0.003)
    assert engine.step_time(mixed, 1) == pytest.approx(bare.step_time(mixed, 1))


def test_a_scaled_profile_prices_every_step_and_overhead_by_the_factor():
    token = [Sample(b, c, 0.030 + 1e-3 * b + 1e-7 * b * c) for b in (1, 2, 4) for c in (32, 128, 512)]
    prompt = [Sample(b, s, 0.040 + 1e-5 * b * s + 2e-9 * b * s * s) for b in (1, 2, 4) for s in (16, 64, 256)]
    prof = Profile(model_shape("smollm2-135m"), "1xCPU", tuple(prompt), tuple(token), {}, pass_overhead_s=0.004,
                   co_run=(1.3, 1.2), engine_host_s=0.003, seq_overhead_s=0.001, hop_overhead_s=0.002,
                   prompt_overhead_s=0.005)
    slow = prof.scaled(1.25)
    assert slow.co_run == prof.co_run  # a ratio, not a time
    for executor in (False, True):
        base, scaled = ProfiledPerfModel(prof, executor=executor), ProfiledPerfModel(slow, executor=executor)
        for shape in (BatchShape(decode_seqs=3, decode_context=300), BatchShape.of([(16, 16), (1, 40)]),
                      BatchShape.of([(200, 200)])):
            for depth in (1, 2):
                assert scaled.step_time(shape, depth) == pytest.approx(1.25 * base.step_time(shape, depth))
    assert prof.scaled(1.0) == prof
    with pytest.raises(ValueError, match="> 0"):
        prof.scaled(0.0)


def test_profile_roundtrip(tmp_path):
    prof = Profile(model_shape("opt-13b"), "2xA100-80GB", (Sample(1, 2, 0.5),), (Sample(3, 4, 0.25),), {"k": 1},
                   pass_overhead_s=0.004, co_run=(1.1, 1.2), engine_host_s=0.003, seq_overhead_s=0.001,
                   hop_overhead_s=0.002, prompt_overhead_s=0.005)
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof
    doc = json.loads((tmp_path / "p.json").read_text())  # a profile written before the split
    doc["stage_overhead_s"] = doc.pop("pass_overhead_s")
    for k in ("seq_overhead_s", "hop_overhead_s", "prompt_overhead_s"):
        doc.pop(k)
    (tmp_path / "old.json").write_text(json.dumps(doc))
    assert Profile.load(tmp_path / "old.json") == replace(prof, seq_overhead_s=0.0, hop_overhead_s=0.0, prompt_overhead_s=0.0)


def test_merge_profiles_keeps_every_sample_and_the_median_terms():
    from kvflow.perf.calibrate import merge_profiles

    shape = model_shape("smollm2-135m")
    runs = [Profile(shape, "1xCPU", (Sample(1, 8, 0.1 * k),), (Sample(1, 24, 0.03 * k), Sample(2, 24, 0.04 * k)), {"r": k},
                    pass_overhead_s=0.002 * k, co_run=(1.0 + 0.1 * k, 1.0 + 0.2 * k), engine_host_s=0.001 * k,
                    seq_overhead_s=0.0005 * k, hop_overhead_s=0.001 * k, prompt_overhead_s=0.004 * k) for k in (1, 3, 2)]
    m = merge_profiles(runs)
    assert [(s.batch, s.length) for s in m.prompt] == [(1, 8)] * 3
    assert [s.seconds for s in m.prompt] == pytest.approx([0.1, 0.3, 0.2])
    assert [s.seconds for s in m.token] == pytest.approx([0.03, 0.04, 0.09, 0.12, 0.06, 0.08])
    assert (m.pass_overhead_s, m.seq_overhead_s, m.hop_overhead_s) == pytest.approx((0.004, 0.001, 0.002))
    assert (m.prompt_overhead_s, m.engine_host_s) == pytest.approx((0.008, 0.002))
    assert m.co_run == pytest.approx((1.2, 1.4))
    assert m.meta["calibrations"] == 3
    # engine-only windows: their samples join the fits; the worker terms they did not measure do not count
    window = Profile(shape, "1xCPU", (Sample(1, 8, 0.5),), (Sample(1, 24, 0.05),), {}, engine_host_s=0.010)
    m2 = merge_profiles(runs, [window, window])
    assert [s.seconds for s in m2.prompt] == pytest.approx([0.1, 0.3, 0.2, 0.5, 0.5])
    assert len(m2.token) == 8 and m2.pass_overhead_s == pytest.approx(0.004) and m2.co_run == pytest.approx((1.2, 1.4))
    assert m2.engine_host_s == pytest.approx(0.003)  # median of 1, 3, 2, 10, 10 ms
    assert (m2.meta["calibrations"], m2.meta["engine_windows"]) == (3, 5)
    with pytest.raises(ValueError):
        merge_profiles([runs[0], replace(runs[1], shape=model_shape("opt-13b"))])
    with pytest.raises(ValueError):
        merge_profiles([])


def test_profile_engine_visits_every_shape_once_per_pass_in_shuffled_order(tiny_ckpt_dir, monkeypatch):
    """A slow spell of the machine must not price one shape: each pass times every shape once, in an
    order of its own; a prefill sample is its shape's median over the passes."""
    import kvflow.perf.calibrate as cal

    calls, returned, value = [], {}, iter(range(1, 1000))

    def prefill(engine, b, s, repeats, rng, warm_up=True):
        calls.append(("prefill", b, s))
        returned.setdefault((b, s), []).append(float(next(value)))
        return returned[(b, s)][-1]

    def decode(engine, b, c, steps, rng, timer=None):
        calls.append(("decode", b, c))
        return [Sample(b, c + 2 + k, 0.01) for k in range(steps)]

    monkeypatch.setattr(cal, "time_prefill", prefill)
    monkeypatch.setattr(cal, "time_decode", decode)
    monkeypatch.setattr(cal.ForwardTimer, "__init__", lambda self, engine: setattr(self, "host_s", [0.001]))
    prof = cal.profile_engine(str(tiny_ckpt_dir), (1, 2), (4, 8, 12), (8, 16), repeats=3, decode_steps=2)
    shapes = {("prefill", b, s) for b in (1, 2) for s in (4, 8, 12)} | {("decode", b, c) for b in (1, 2) for c in (8, 16)}
    warm, timed = calls[0], calls[1:]
    assert warm == ("prefill", 2, 12) and len(timed) == 3 * len(shapes)
    passes = [timed[k * len(shapes):(k + 1) * len(shapes)] for k in range(3)]
    assert all(set(p) == shapes and len(set(p)) == len(p) for p in passes)
    assert len({tuple(p) for p in passes}) > 1  # not one fixed order
    for sample in prof.prompt:  # the median of the values returned for that shape
        got = returned[(sample.batch, sample.length)][-3:]  # the warm-up's is not among them
        assert sample.seconds == sorted(got)[1]
    assert len(prof.token) == 3 * 4 * 2 and prof.meta["repeats"] == 3


def test_recommend_prefers_disaggregation_for_long_prompts():
    """OPT-66B on 6 x 2xA100 (DéjàVu Table 2's setting): the paper's own choices come out —
    Baseline (6p, 16b), Baseline-DP (3d, 2p, 16b), DéjàVu ((2p, 16b), (4p, 16b))."""
    perf = AnalyticPerfModel(model_shape("opt-66b"), machine("2xA100-80GB"))
    space = SearchSpace(1000, 2024, 215.0, microbatches=(4, 8, 16))
    plan = recommend(perf, 6, space, lambda b: synthetic(600, 1000, LengthDist(), None, 0, group=b))
    assert plan.formulas.disaggregation_wins
    assert (plan.formulas.min_prompt_depth, plan.formulas.min_token_depth) == (2, 2)
    assert plan.best["baseline"].layout.label() == "(6p, 16b)"
    assert plan.best["baseline-dp"].layout.label() == "(3d, 2p, 16b)"
    assert plan.best["disaggregated"].layout.label() == "((2p, 16b), (4p, 16b))"
    assert set(plan.best) == {"baseline", "baseline-dp", "disaggregated"}
    assert plan.recommended.layout.kind == "disaggregated"
    assert plan.recommended.summary.makespan_s < plan.best["baseline"].summary.makespan_s
    with pytest.raises(Infeasible):
        recommend(AnalyticPerfModel(model_shape("bloom-176b"), machine("4xV100-16GB")), 2, space,
                  lambda b: synthetic(10, 1000, LengthDist(), None, 0))


def test_goodput_binary_search_brackets_the_target():
    perf = AnalyticPerfModel(model_shape("opt-13b"), machine("1xA100-80GB"))
    lay = Layout(PipelineGroup(1, 4), PipelineGroup(1, 8))
    slo = SLO(ttft=2.0, tpot=0.1)
    wl = lambda r: synthetic(400, 512, LengthDist("lognormal", median=50, p90=150, max_len=400), r, 11)  # noqa: E731
    g = max_rate(perf, lay, wl, slo, target=0.9, hi=2.0, rel_tol=0.05)
    assert g.attainment >= 0.9
    from kvflow.planner.goodput import attainment_at
    assert attainment_at(perf, lay, g.rate * 1.12, wl, slo) < 0.9


def test_profile_tells_the_engines_host_side_work_from_the_forward():
    from conftest import tiny_engine

    from kvflow.perf.calibrate import ForwardTimer, time_decode

    eng = tiny_engine(num_kv_blocks=64, block_size=4)
    timer = ForwardTimer(eng)
    samples = time_decode(eng, 2, 8, 3, np.random.default_rng(0), timer)
    assert [(s.batch, s.length) for s in samples] == [(2, 10), (2, 11), (2, 12)]
    assert len(timer.host_s) == 3 and all(0 < h < s.seconds for h, s in zip(timer.host_s, samples))
