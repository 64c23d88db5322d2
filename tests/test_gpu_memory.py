"""Sizing the KV cache from GPU memory (`gpu_memory_utilization`): the budget's arithmetic and the
config's checks here; the measurement on a device in tests/test_cuda.py."""

from __future__ import annotations

import pytest

from kvflow.config import EngineConfig
from kvflow.engine.memory import DeviceMemory, kv_budget_bytes

GIB = 2**30


def test_the_budget_is_the_fraction_less_what_is_in_use_and_a_steps_peak():
    mem = DeviceMemory(total=80 * GIB, free=75 * GIB, activations=GIB)  # 5 GiB held: weights, other processes
    assert kv_budget_bytes(mem, 0.9, reserve=GIB // 2) == int(0.9 * 80 * GIB) - 5 * GIB - GIB - GIB // 2
    assert kv_budget_bytes(mem, 1.0, reserve=0) == 74 * GIB  # all of it: everything free but the step's peak
    # memory another process holds is not free: a second engine gets what the first left
    shared = DeviceMemory(total=80 * GIB, free=20 * GIB, activations=GIB)
    assert kv_budget_bytes(shared, 0.9, reserve=0) == int(0.9 * 80 * GIB) - 60 * GIB - GIB


def test_no_room_left_says_what_took_it():
    mem = DeviceMemory(total=80 * GIB, free=10 * GIB, activations=2 * GIB)
    with pytest.raises(ValueError, match=r"leaves no room for a KV cache: 40.0 GiB allowed, 70.0 GiB already in use"):
        kv_budget_bytes(mem, 0.5)


@pytest.mark.parametrize("kwargs, says", [
    (dict(gpu_memory_utilization=0.9), "needs a CUDA device"),
    (dict(gpu_memory_utilization=1.2), "fraction in"),
    (dict(gpu_memory_utilization=True), "fraction in"),
])
def test_the_config_refuses_what_cannot_work(kwargs, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig(**kwargs)
