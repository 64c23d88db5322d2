"""Hardware specs: one accelerator (`DeviceSpec`) and one machine of several of them (`MachineSpec`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """Peak numbers of one device; efficiencies turn peaks into what kernels actually reach."""

    name: str
    flops: float  # peak dense FLOP/s at the serving dtype
    mem_bandwidth: float  # bytes/s of device memory
    mem_bytes: float  # device memory capacity
    compute_efficiency: float = 0.5  # fraction of peak FLOP/s a prefill GEMM reaches
    bandwidth_efficiency: float = 0.7  # fraction of peak bandwidth a decode step reaches

    def __post_init__(self) -> None:
        if min(self.flops, self.mem_bandwidth, self.mem_bytes) <= 0:
            raise ValueError(f"device {self.name}: flops, bandwidth and memory must be positive")
        for eff in (self.compute_efficiency, self.bandwidth_efficiency):
            if not 0 < eff <= 1:
                raise ValueError(f"device {self.name}: efficiencies must be in (0, 1]")


@dataclass(frozen=True)
class MachineSpec:
    """A machine (one pipeline stage): `devices` running tensor parallelism, one NIC, a price.

    `link_bandwidth` is the inter-machine network (bytes/s) used by pipeline activations and KV
    streaming; `intra_bandwidth` the device-to-device link used by tensor-parallel all-reduces;
    `host_bandwidth` one device's host link (PCIe), used by microbatch swapping: each device has
    its own, so a machine swaps at `devices` times it.
    """

    device: DeviceSpec
    devices: int
    link_bandwidth: float
    intra_bandwidth: float
    host_bandwidth: float
    cost_per_hour: float = 1.0
    memory_reserve: float = 0.1  # fraction of device memory kept for activations and workspace

    def __post_init__(self) -> None:
        if self.devices < 1:
            raise ValueError("a machine needs at least one device")
        if min(self.link_bandwidth, self.intra_bandwidth, self.host_bandwidth) <= 0:
            raise ValueError("bandwidths must be positive")
        if not 0 <= self.memory_reserve < 1:
            raise ValueError("memory_reserve must be in [0, 1)")
        if self.cost_per_hour < 0:
            raise ValueError("cost_per_hour must be non-negative")

    @property
    def name(self) -> str:
        return f"{self.devices}x{self.device.name}"

    @property
    def usable_memory(self) -> float:
        """Bytes of device memory per machine available to weights and KV cache."""
        return self.devices * self.device.mem_bytes * (1 - self.memory_reserve)

    def with_link(self, link_bandwidth: float) -> "MachineSpec":
        return replace(self, link_bandwidth=link_bandwidth)


DEVICES: dict[str, DeviceSpec] = {
    # Vendor datasheet peaks (dense fp16/bf16 tensor-core FLOP/s, HBM bandwidth).
    "A100-80GB": DeviceSpec("A100-80GB", flops=312e12, mem_bandwidth=2.039e12, mem_bytes=80 * GB),
    "V100-16GB": DeviceSpec("V100-16GB", flops=125e12, mem_bandwidth=0.9e12, mem_bytes=16 * GB),
    "H100-80GB": DeviceSpec("H100-80GB", flops=989e12, mem_bandwidth=3.35e12, mem_bytes=80 * GB),
}

# NVLink per device (bytes/s) for the tensor-parallel all-reduce; PCIe per device for swapping.
_INTRA = {"A100-80GB": 300 * GB, "V100-16GB": 150 * GB, "H100-80GB": 450 * GB}
_HOST = {"A100-80GB": 25 * GB, "V100-16GB": 12 * GB, "H100-80GB": 50 * GB}


def cpu_device(cores: int | None = None) -> DeviceSpec:
    """Nominal spec of this CPU: ~16 fp32 FLOP/cycle/core (AVX2 FMA) at ~2.5 GHz, ~10 GB/s DRAM.

    These are round nominal numbers, not measurements; `kvflow profile` measures the real engine
    and its fitted `ProfiledPerfModel` supersedes this spec for prediction.
    """
    n = cores or os.cpu_count() or 1
    total_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceSpec(f"CPU-{n}core", flops=n * 16 * 2.5e9, mem_bandwidth=10 * GB, mem_bytes=float(total_mem),
                      compute_efficiency=0.3, bandwidth_efficiency=0.5)


def machine(spec: str, link_gbps: float = 100.0, cost_per_hour: float = 1.0) -> MachineSpec:
    """Parse 'NxDEVICE' (e.g. '2xA100-80GB', '4xV100-16GB', '1xCPU') into a MachineSpec.

    `link_gbps` is the inter-machine network in gigabits per second (DéjàVu's VMs: 100 Gbps).
    """
    count_s, sep, dev_name = spec.partition("x")
    if not sep or not count_s.isdigit():
        raise ValueError(f"machine spec {spec!r} must look like '2xA100-80GB'")
    if dev_name.upper() == "CPU":
        dev = cpu_device()
        return MachineSpec(dev, int(count_s), link_bandwidth=link_gbps * 1e9 / 8, intra_bandwidth=10 * GB,
                           host_bandwidth=10 * GB, cost_per_hour=cost_per_hour, memory_reserve=0.5)
    if dev_name not in DEVICES:
        raise ValueError(f"unknown device {dev_name!r}; known: {sorted(DEVICES)} and CPU")
    return MachineSpec(DEVICES[dev_name], int(count_s), link_bandwidth=link_gbps * 1e9 / 8,
                       intra_bandwidth=_INTRA[dev_name], host_bandwidth=_HOST[dev_name],
                       cost_per_hour=cost_per_hour)
