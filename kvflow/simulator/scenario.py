"""Scenario files (YAML): model, machine type, workload and the cluster sizes to sweep.

    name: opt66b-2xa100
    model: opt-66b                  # a name in kvflow.perf.MODELS
    machine: 2xA100-80GB            # NxDEVICE
    link_gbps: 100
    cost_per_hour: 1.0
    machines: [2, 4, 8]
    microbatches: [2, 4, 8, 16, 32]
    swapping: false
    memory_reserve: 0.1             # fraction of device memory kept back (activations, workspace)
    dispatch: shared                # Baseline-DP: 'shared' queue, or 'round_robin' (request i -> pipeline i mod d)
    workload: {requests: 2048, prompt_len: 1000, output: {kind: lmsys, max_len: 1024},
               rate: null, per_microbatch_lengths: true, seed: 0}
    # or workload: {trace: path/to/AzureLLMInferenceTrace_conv.csv, limit: 5000, time_scale: 1.0}
    paper: {2: {baseline: "(2p, 16b)", ...}}   # optional published configurations to compare
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

from kvflow.perf.hardware import MachineSpec, machine
from kvflow.perf.model_shape import ModelShape, model_shape
from kvflow.simulator.workload import LengthDist, Workload, azure_trace, synthetic


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int = 2048
    prompt_len: int = 1000
    output: LengthDist = field(default_factory=LengthDist)
    rate: float | None = None  # None: every request arrives at t=0 (offline makespan)
    per_microbatch_lengths: bool = True
    seed: int = 0
    trace: str | None = None
    limit: int | None = None
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.requests < 1 or self.prompt_len < 1:
            raise ValueError("workload needs requests >= 1 and prompt_len >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("rate must be positive (or null for offline)")

    def build(self, microbatch: int = 1, rate: float | None = None, requests: int | None = None) -> Workload:
        """The workload; `microbatch` groups output lengths when `per_microbatch_lengths`."""
        if self.trace:
            return azure_trace(self.trace, self.limit, self.time_scale, self.output.max_len)
        group = microbatch if self.per_microbatch_lengths else 1
        return synthetic(requests or self.requests, self.prompt_len, self.output,
                         rate if rate is not None else self.rate, self.seed, group)

    @property
    def mean_output(self) -> float:
        import numpy as np

        return float(np.mean(self.build().output_len))

    @property
    def max_tokens(self) -> int:
        if self.trace:
            return self.build().max_tokens
        return self.prompt_len + self.output.max_len


@dataclass(frozen=True)
class Scenario:
    name: str
    shape: ModelShape
    machine: MachineSpec
    workload: WorkloadSpec
    machines: tuple[int, ...]
    microbatches: tuple[int, ...] = (2, 4, 8, 16, 32)
    swapping: bool = False
    paper: dict = field(default_factory=dict)
    dispatch: str = "shared"  # Baseline-DP dispatch rule (`SimConfig.dispatch`)

    def __post_init__(self) -> None:
        if not self.machines or min(self.machines) < 1:
            raise ValueError("scenario needs machine counts >= 1")
        if self.dispatch not in ("shared", "round_robin"):
            raise ValueError("dispatch must be 'shared' or 'round_robin'")


def load_scenario(path: str | Path) -> Scenario:
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a scenario is a YAML mapping")
    unknown = set(doc) - {"name", "model", "machine", "link_gbps", "cost_per_hour", "machines", "microbatches",
                          "swapping", "workload", "paper", "memory_reserve", "dispatch"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
    w = dict(doc.get("workload", {}))
    w["output"] = LengthDist(**w.get("output", {}))
    spec = machine(doc["machine"], doc.get("link_gbps", 100.0), doc.get("cost_per_hour", 1.0))
    if "memory_reserve" in doc:
        spec = replace(spec, memory_reserve=float(doc["memory_reserve"]))
    return Scenario(
        name=doc.get("name", Path(path).stem), shape=model_shape(doc["model"]), machine=spec,
        workload=WorkloadSpec(**w), machines=tuple(doc.get("machines", [2, 4, 8])),
        microbatches=tuple(doc.get("microbatches", [2, 4, 8, 16, 32])), swapping=bool(doc.get("swapping", False)),
        paper={int(k): v for k, v in (doc.get("paper") or {}).items()}, dispatch=doc.get("dispatch", "shared"))
