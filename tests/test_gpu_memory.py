"""Sizing the KV cache from GPU memory (`gpu_memory_utilization`): the budget's arithmetic and the
config's checks here; the measurement on a device in tests/test_cuda.py."""

from __future__ import annotations

import pytest

from kvflow.config import EngineConfig
from kvflow.controller.replica_store import SHM_SHARE, fit_replicas
from kvflow.engine.memory import DeviceMemory, StageMemory, check_pool_fits, kv_budget_bytes, pipeline_pools

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


# ---------------------------------------------------------------------------------------- pipelines
MIB = 2**20


def stage(device: str, free_gib: float, read_at: float, block_mib: float = 1, activations_gib: float = 1, total_gib: int = 80):
    return StageMemory(device, total_gib * GIB, int(free_gib * GIB), read_at, int(activations_gib * GIB), int(block_mib * MIB))


def test_a_pipelines_pool_is_the_fewest_blocks_any_of_its_stages_has_room_for():
    # two GPUs of 80 GiB at 0.9 (72 GiB allowed); on b another process holds 20 GiB more than on a
    stages = {"colocated-0": ("colocated", stage("GPU-a", 70, 1.0)), "colocated-1": ("colocated", stage("GPU-b", 50, 1.0))}
    # a: 72 - 10 in use - 1 step - 0.5 reserve = 60.5 GiB; b: 72 - 30 - 1 - 0.5 = 40.5 GiB; 1 MiB blocks
    assert pipeline_pools(stages, 0.9, reserve=GIB // 2) == {"colocated": 40 * 1024 + 512}
    # each pipeline its own minimum
    stages["token-0"] = ("token", stage("GPU-c", 70, 1.0, block_mib=2))
    assert pipeline_pools(stages, 0.9, reserve=GIB // 2) == {"colocated": 41472, "token": 60 * 512 + 256}


def test_pools_are_cut_to_what_their_replicas_can_hold_in_dev_shm():
    """A replica mirrors its stage block for block: pools sized from an 80 GiB GPU cannot all be
    mirrored in a host's /dev/shm, so the replicated ones are cut by one factor to SHM_SHARE of its
    room; a pipeline without replicas keeps its pool, and so does everyone when the room suffices."""
    pools = {"prompt": 60_000, "token": 40_000}
    replicas = {"token": 2 * 2**20}  # two stages of 1 MiB blocks each: 2 MiB of replicas per block
    assert fit_replicas(pools, replicas, 100 * GIB) == pools  # 78 GiB of replicas fit in 90 GiB
    cut = fit_replicas(pools, replicas, 40 * GIB)
    assert cut["prompt"] == 60_000 and cut["token"] == int(40_000 * SHM_SHARE * 40 * GIB / (80_000 * 2**20))
    assert cut["token"] * replicas["token"] <= SHM_SHARE * 40 * GIB < (cut["token"] + 1) * replicas["token"]
    both = fit_replicas(pools, {"prompt": 2**20, "token": 2**20}, 50 * GIB)  # one factor for both
    assert both["prompt"] / pools["prompt"] == pytest.approx(both["token"] / pools["token"], rel=1e-3)
    assert (both["prompt"] + both["token"]) * 2**20 <= SHM_SHARE * 50 * GIB
    assert fit_replicas(pools, replicas, 0) == {"prompt": 60_000, "token": 1}  # (at least one block)
    assert fit_replicas(pools, replicas, None) == pools  # no /dev/shm: nothing to cut against


def test_stages_on_one_gpu_share_its_room_and_the_latest_reading_counts():
    """Two stages on one GPU: the later reading (both loaded, both idle) is the one that counts; the
    room left, less both steps and reserves, holds the same blocks of each."""
    stages = {"colocated-0": ("colocated", stage("GPU-a", 74, 1.0, block_mib=1)),  # read before the other had loaded
              "colocated-1": ("colocated", stage("GPU-a", 70, 2.0, block_mib=2))}
    pools = pipeline_pools(stages, 0.9, reserve=GIB // 2)
    room = 72 * GIB - 10 * GIB - 2 * GIB - GIB  # 59 GiB: 10 GiB in use, two steps, two reserves
    assert pools == {"colocated": room // (3 * MIB)} == {"colocated": 20138}
    # read in the other order, the other reading counts
    stages["colocated-0"] = ("colocated", stage("GPU-a", 74, 3.0, block_mib=1))
    assert pipeline_pools(stages, 0.9, reserve=GIB // 2) == {"colocated": (room + 4 * GIB) // (3 * MIB)}
    # a prompt and a token pipeline on one GPU get the same blocks each, as num_kv_blocks gives both
    shared = {"prompt-0": ("prompt", stage("GPU-a", 70, 1.0)), "token-0": ("token", stage("GPU-a", 69, 2.0))}
    blocks = (72 * GIB - 11 * GIB - 2 * GIB - GIB) // (2 * MIB)
    assert pipeline_pools(shared, 0.9, reserve=GIB // 2) == {"prompt": blocks, "token": blocks}
    # the same stages on their own GPUs get more than their share of one
    apart = {"prompt-0": ("prompt", stage("GPU-a", 70, 1.0)), "token-0": ("token", stage("GPU-b", 70, 1.0))}
    assert pipeline_pools(apart, 0.9, reserve=GIB // 2) == {"prompt": 61952, "token": 61952} and 61952 > 2 * blocks


def test_a_gpu_with_no_room_names_its_stages():
    stages = {"colocated-0": ("colocated", stage("GPU-a", 70, 1.0)), "colocated-1": ("colocated", stage("GPU-b", 5, 1.0))}
    with pytest.raises(ValueError, match=r"^stage colocated-1 on GPU GPU-b: gpu_memory_utilization 0.9 leaves no room "
                                         r"for a KV cache: 72.0 GiB allowed, 75.0 GiB already in use"):
        pipeline_pools(stages, 0.9, reserve=GIB // 2)
    # room, but less than one block of the layers of every stage on the GPU (2 x 2 MiB)
    tight = {name: ("colocated", stage("GPU-a", 9, read_at, block_mib=2, activations_gib=0, total_gib=10))
             for name, read_at in (("colocated-0", 1.0), ("colocated-1", 2.0))}
    room = int(0.9 * 10 * GIB) - 1 * GIB - 2 * (4095 * MIB)  # 10 GiB GPU, 1 GiB in use, two reserves
    assert 0 < room < 4 * MIB
    with pytest.raises(ValueError, match=r"^stages colocated-0, colocated-1 on GPU GPU-a: gpu_memory_utilization 0.9 "
                                         r"leaves 0.002 GiB for KV, less than one block of their layers \(4.00 MiB\)"):
        pipeline_pools(tight, 0.9, reserve=4095 * MIB)


def test_a_replacement_must_fit_the_live_pipelines_pool():
    mem = stage("GPU-a", 30, 1.0, block_mib=2)  # 72 - 50 in use - 1 step - 0.5 reserve = 20.5 GiB: 10496 blocks of 2 MiB
    check_pool_fits(mem, 0.9, 10496, reserve=GIB // 2)
    with pytest.raises(ValueError, match=r"the pipeline's pool of 10497 blocks \(20.50 GiB of this stage's KV\) does "
                                         r"not fit on its GPU: gpu_memory_utilization 0.9 leaves 20.50 GiB now"):
        check_pool_fits(mem, 0.9, 10497, reserve=GIB // 2)
    busier = stage("GPU-a", 5, 1.0, block_mib=2)  # nothing left of the fraction at all: the same message
    with pytest.raises(ValueError, match=r"pool of 1 blocks .* leaves 0.00 GiB now, and a replacement cannot change"):
        check_pool_fits(busier, 0.9, 1, reserve=GIB // 2)


def test_what_a_stage_measured_crosses_the_wire():
    from kvflow.config import to_dict
    from kvflow.wire import Hello, decode, encode, new_secret

    mem = stage("GPU-5f1c", 70.25, 12345.678, block_mib=0.5)
    secret = new_secret()
    msg, _ = decode(encode(Hello("colocated-1", "tcp://127.0.0.1:5555", to_dict(mem)), secret), secret)
    assert StageMemory(**msg.memory) == mem
    assert decode(encode(Hello("colocated-1", "tcp://127.0.0.1:5555"), secret), secret)[0].memory == {}


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_serve_takes_the_fraction_for_the_pipeline_modes_on_cuda(mode):
    from kvflow.cli.main import build_parser
    from kvflow.cli.serve import _check_mode

    on_cuda = build_parser().parse_args(["serve", "--mode", mode, "--device", "cuda", "--gpu-memory-utilization", "0.9"])
    _check_mode(on_cuda)  # accepted (the CPU's refusal: tests/test_cli_usability.py)
    on_cpu = build_parser().parse_args(["serve", "--mode", mode, "--gpu-memory-utilization", "0.9"])
    with pytest.raises(ValueError, match="on CPU, give --kv-cache-gb"):
        _check_mode(on_cpu)
