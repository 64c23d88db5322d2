"""Appendix D formulas against hand-computed cases."""

from __future__ import annotations

import math

import pytest

from kvflow.planner.formulas import (Infeasible, balanced_split, colocated_inverse_throughput,
                                     disaggregation_threshold, min_prompt_depth, min_token_depth,
                                     prompt_inverse_throughput, streaming_overhead, token_inverse_throughput)


def test_eq2_prompt_depth_bound():
    # L=64 layers, W0=2 GB, C0=0.5 GB, M=72 GB: ceil(64*2.5/72) = ceil(2.22) = 3.
    assert min_prompt_depth(64, 2.0, 0.5, 72.0) == 3
    assert min_prompt_depth(64, 2.0, 0.5, 160.0) == 1
    with pytest.raises(Infeasible):
        min_prompt_depth(64, 2.0, 0.5, 2.4)


def test_eq3_token_depth_bound():
    # L=64, W0=2, C0=0.5, K0=0.25, M=80: 64*2 / (80 - 64*0.75) = 128/32 = 4.
    assert min_token_depth(64, 2.0, 0.5, 0.25, 80.0) == 4
    # 128 / (80 - 64*0.8) = 128/28.8 = 4.44 -> 5
    assert min_token_depth(64, 2.0, 0.5, 0.3, 80.0) == 5
    with pytest.raises(Infeasible):
        min_token_depth(64, 2.0, 0.5, 0.75, 80.0)


def test_eq4_and_phase_inverse_throughputs():
    # D=4, Y=2, t=0.1, N=10: 3*1.9/4 + 2 + 1 = 4.425
    assert colocated_inverse_throughput(4, 2.0, 0.1, 10) == pytest.approx(4.425)
    assert colocated_inverse_throughput(1, 2.0, 0.1, 10) == pytest.approx(3.0)
    assert token_inverse_throughput(4, 2, 0.1, 10) == pytest.approx(2.0)  # N D t / D_t
    assert prompt_inverse_throughput(4, 2, 2.0, 1.5) == pytest.approx(6.0)  # m D Y / D_p


def test_eq5_threshold():
    assert disaggregation_threshold(8, 1.0) == pytest.approx(1.0)  # 7 / (8*1 - 1)
    assert disaggregation_threshold(4, 1.5) == pytest.approx(3.0)  # 3 / (4*0.5 - 1)
    assert disaggregation_threshold(1, 1.0) == math.inf
    assert disaggregation_threshold(10, 2.0) == math.inf


@pytest.mark.parametrize("d", [2, 3, 5, 8, 16])
@pytest.mark.parametrize("m", [1.0, 1.3, 1.7])
@pytest.mark.parametrize("ratio", [0.5, 1.2, 3.0, 20.0, 100.0])
def test_eq5_agrees_with_eq4_versus_balanced_split(d, m, ratio):
    """Eq. 5 is exactly the condition I_t (at the real-valued split of eq. 6) < I_c (eq. 4)."""
    t, n = 0.01, 50
    y = ratio * t
    split = balanced_split(d, y, t, n, m)
    i_dis = token_inverse_throughput(d, split.d_t, t, n)
    assert i_dis == pytest.approx(prompt_inverse_throughput(d, split.d_p, y, m))  # balanced
    wins = i_dis < colocated_inverse_throughput(d, y, t, n)
    assert wins == (y / t > disaggregation_threshold(d, m))


def test_eqs6_7_split_hand_case():
    # D=10, Y=4, t=0.1, N=100, m=1: D_t = 10*10/(4+10) = 7.142857, D_p = 2.857143.
    s = balanced_split(10, 4.0, 0.1, 100, 1.0)
    assert s.d_t == pytest.approx(100 / 14)
    assert s.d_p == pytest.approx(40 / 14)
    # Integers: p=3 -> max(100/7, 40/3) = 14.2857; p=2 -> 20; p=4 -> 16.67.
    assert (s.prompt_machines, s.token_machines) == (3, 7)
    assert s.inverse_throughput == pytest.approx(100 / 7)


def test_split_respects_memory_bounds():
    s = balanced_split(10, 4.0, 0.1, 100, 1.0, min_p=5)
    assert (s.prompt_machines, s.token_machines) == (5, 5)
    with pytest.raises(Infeasible):
        balanced_split(4, 4.0, 0.1, 100, 1.0, min_p=3, min_t=2)


def test_streaming_overhead():
    assert streaming_overhead(0.856, 3.1) == 1.0  # Table 6, 100 Gbps: fully hidden
    assert streaming_overhead(4.28, 3.1) == pytest.approx(4.28 / 3.1)  # 20 Gbps: not hidden
