"""The `PerfModel` interface (per-stage prompt and token times, KV bytes, transfers, memory) and
its analytic implementation from a model shape and a machine spec."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import NamedTuple

from kvflow.perf.hardware import MachineSpec
from kvflow.perf.model_shape import ModelShape


class BatchShape(NamedTuple):
    """What a batch costs depends on: prefill chunks (`prefill_seqs` sequences with more than one
    new token; `prefill_tokens` new tokens and `prefill_attention` = sum of new x context after,
    b*s^2 for b whole prompts of s) and decode steps (`decode_seqs` sequences, `decode_context` =
    sum of their contexts). (A named tuple: the simulator makes one per pass and keys its prices by
    it, and a frozen dataclass costs ~1 us to make and as much to hash.)"""

    prefill_seqs: int = 0
    prefill_tokens: int = 0
    prefill_attention: int = 0
    decode_seqs: int = 0
    decode_context: int = 0

    @classmethod
    def of(cls, seqs) -> "BatchShape":
        """From (num_new_tokens, context_after) pairs."""
        ps = pt = pa = ds = dc = 0
        for n, end in seqs:
            if n > 1:
                ps, pt, pa = ps + 1, pt + n, pa + n * end
            else:
                ds, dc = ds + 1, dc + end
        return cls(ps, pt, pa, ds, dc)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    @property
    def seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs


class PerfModel(ABC):
    """Predicts the cost of serving `shape` on machines of type `machine`.

    Contract: a pipeline of `depth` machines splits the layers as evenly as possible; the
    `*_stage_time` methods return seconds on the slowest stage (the one that sets the pipeline's
    pace) for one microbatch of `batch` requests. Times are positive and non-decreasing in batch,
    prompt length and context length. No method returns a sentinel: invalid input raises ValueError.
    """

    def __init__(self, shape: ModelShape, machine: MachineSpec) -> None:
        self.shape = shape
        self.machine = machine

    @abstractmethod
    def prompt_stage_time(self, batch: int, prompt_len: int, depth: int) -> float:
        """Seconds one stage spends prefilling `batch` prompts of `prompt_len` tokens."""

    @abstractmethod
    def token_stage_time(self, batch: int, context_len: int, depth: int) -> float:
        """Seconds one stage spends on one decode step of `batch` requests at `context_len`."""

    def step_time(self, batch: "BatchShape", depth: int) -> float:
        """Seconds one stage spends on one batch of the scheduler (`BatchShape`): prefill chunks
        (more than one new token) and decode steps (one new token), possibly mixed. This default
        prices the prefill part as `prompt_stage_time` of its mean chunk and the decode part as
        `token_stage_time` at its mean context, and adds them when a batch has both."""
        t = 0.0
        if batch.prefill_seqs:
            t += self.prompt_stage_time(batch.prefill_seqs, max(1, round(batch.prefill_tokens / batch.prefill_seqs)), depth)
        if batch.decode_seqs:
            t += self.token_stage_time(batch.decode_seqs, max(1, round(batch.decode_context / batch.decode_seqs)), depth)
        return t

    # False where `stage_step_time` differs from stage to stage (the simulator then prices each).
    uniform_stages = True

    def stage_step_time(self, batch: "BatchShape", depth: int, stage: int) -> float:
        """Seconds stage `stage` of a `depth`-stage pipeline spends on `batch`. This default is
        `step_time` (the most loaded stage's) for every stage."""
        return self.step_time(batch, depth)

    # --- tensor parallelism ---------------------------------------------------------------------

    @property
    def tensor_parallel_degrees(self) -> tuple[int, ...]:
        """Devices per stage this model can price: only the machine's own count unless a subclass
        models tensor parallelism (a profile measures one configuration, not others)."""
        return (self.machine.devices,)

    def with_tensor_parallel(self, devices: int) -> "PerfModel":
        """The same model and device type with `devices` devices per stage (tensor parallel).
        Raises ValueError for a degree outside `tensor_parallel_degrees`."""
        if devices != self.machine.devices:
            raise ValueError(f"{type(self).__name__} prices only {self.machine.devices} devices per stage, "
                             f"not {devices}")
        return self

    # --- derived, shared by every source -------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers."""
        return self.shape.kv_bytes_per_token

    def co_run_factor(self, batch: "BatchShape") -> float:
        """How much slower `batch` runs while another worker of the same host computes (1: machines
        of their own, as the analytic model assumes; a profile measures it)."""
        return 1.0

    def transfer_time(self, nbytes: float, bandwidth: float | None = None) -> float:
        """Seconds to move `nbytes` over a link (default: the machine's network link)."""
        if nbytes < 0:
            raise ValueError("cannot transfer a negative number of bytes")
        return nbytes / (bandwidth or self.machine.link_bandwidth)

    def kv_transfer_time(self, tokens: int, depth: int, stage: int | None = None) -> float:
        """The one KV-transfer time of planner and simulator: seconds for stage `stage` of a
        `depth`-stage pipeline (default: its most loaded stage) to send the KV of `tokens` tokens of
        its layers over its own network link. Every prompt stage streams its layers' KV in
        parallel, starting when it starts computing them (DéjàVu Table 6: 10.7 GB per stage and
        microbatch of BLOOM-176B on 3 stages, 0.856 s at 100 Gbps)."""
        layers = self.shape.layers_per_stage(depth) if stage is None else self.shape.stage_layers(depth, stage)
        return self.transfer_time(tokens * layers * self.shape.kv_bytes_per_token_layer)

    def hop_time(self, batch: int, tokens: int) -> float:
        """Seconds to send one microbatch's activations from one stage to the next."""
        return self.transfer_time(batch * tokens * self.shape.hidden * self.shape.dtype_bytes)

    def swap_in_time(self, batch: int, context_len: int, depth: int) -> float:
        """Seconds to bring one microbatch's KV of one stage from host to device memory. Each of the
        stage's devices holds its tensor-parallel share of that KV and swaps it over its own host
        link (`MachineSpec.host_bandwidth` is per device), so the stage moves it at devices x that."""
        nbytes = batch * context_len * self.shape.layers_per_stage(depth) * self.shape.kv_bytes_per_token_layer
        return self.transfer_time(nbytes, self.machine.host_bandwidth * self.machine.devices)

    def stage_weight_bytes(self, depth: int) -> int:
        return self.shape.layers_per_stage(depth) * self.shape.layer_weight_bytes + (
            self.shape.head_weight_bytes if depth == 1 else 0)

    def kv_capacity_tokens(self, depth: int, resident: int | None = None) -> int:
        """The one memory-feasibility function of planner and simulator: tokens of KV a pipeline of
        `depth` stages holds, limited by its most loaded stage's memory beside that stage's weights
        (0 when the weights alone do not fit). `resident` < depth: only that many of the `depth`
        microbatches keep their KV on the device (swapping, DéjàVu §4.2.2), the rest lives in host
        memory, so the pipeline holds depth/resident times more."""
        free = self.machine.usable_memory - self.stage_weight_bytes(depth)
        per_token = self.shape.layers_per_stage(depth) * self.shape.kv_bytes_per_token_layer
        tokens = max(0, int(free // per_token))
        return tokens * depth // resident if resident else tokens

    def max_microbatch(self, depth: int, max_tokens: int, slots: int, block_size: int = 1) -> int:
        """Largest microbatch of which `slots` resident microbatches, each request holding
        `max_tokens` tokens of KV in blocks of `block_size`, fit beside one stage's weights; 0 when
        even the weights do not fit (a count, not a flag)."""
        per_request = -(-max_tokens // block_size) * block_size
        return self.kv_capacity_tokens(depth) // (slots * per_request)

    def _slowest_stage(self, layer_time: float, head_time: float, depth: int) -> float:
        """Stages hold ceil or floor of L/depth layers; the LM head sits on a lighter stage."""
        hi = self.shape.layers_per_stage(depth)
        lo = self.shape.layers // depth
        return max(hi * layer_time, lo * layer_time + head_time) if depth > 1 else hi * layer_time + head_time


class AnalyticPerfModel(PerfModel):
    """Roofline model: each layer costs max(FLOPs / effective FLOP rate, bytes / effective
    bandwidth), split over the machine's tensor-parallel devices, plus two ring all-reduces."""

    @property
    def tensor_parallel_degrees(self) -> tuple[int, ...]:
        """Every divisor of the machine's device count (a stage never spans machines)."""
        n = self.machine.devices
        return tuple(d for d in range(1, n + 1) if n % d == 0)

    def with_tensor_parallel(self, devices: int) -> "PerfModel":
        """A stage of `devices` of the machine's devices: memory, compute and host links scale with
        them, the price is their share of the machine's, the network link stays the machine's."""
        if devices not in self.tensor_parallel_degrees:
            raise ValueError(f"tensor-parallel degree {devices} must divide {self.machine.devices}")
        if devices == self.machine.devices:
            return self
        m = self.machine
        share = devices / m.devices
        return AnalyticPerfModel(self.shape, replace(m, devices=devices, cost_per_hour=m.cost_per_hour * share))

    def _roofline(self, flops: float, nbytes: float) -> float:
        dev, n = self.machine.device, self.machine.devices
        return max(flops / (dev.flops * dev.compute_efficiency * n),
                   nbytes / (dev.mem_bandwidth * dev.bandwidth_efficiency * n))

    def _allreduce(self, nbytes: float) -> float:
        n = self.machine.devices
        if n == 1:
            return 0.0
        return 2 * (2 * (n - 1) / n * nbytes / self.machine.intra_bandwidth + 10e-6)

    def prompt_stage_time(self, batch: int, prompt_len: int, depth: int) -> float:
        _check(batch, prompt_len)
        s = self.shape
        tokens = batch * prompt_len
        attn_flops = 2 * batch * prompt_len * prompt_len * s.heads * s.head_dim  # causal QK^T + AV
        layer = self._roofline(2 * s.params_per_layer * tokens + attn_flops,
                               s.layer_weight_bytes + tokens * s.kv_bytes_per_token_layer)
        layer += self._allreduce(tokens * s.hidden * s.dtype_bytes)
        head = self._roofline(2 * s.vocab * s.hidden * batch, s.head_weight_bytes)
        return self._slowest_stage(layer, head, depth)

    def token_stage_time(self, batch: int, context_len: int, depth: int) -> float:
        _check(batch, context_len)
        s = self.shape
        attn_flops = 4 * batch * context_len * s.heads * s.head_dim
        layer = self._roofline(2 * s.params_per_layer * batch + attn_flops,
                               s.layer_weight_bytes + batch * context_len * s.kv_bytes_per_token_layer)
        layer += self._allreduce(batch * s.hidden * s.dtype_bytes)
        head = self._roofline(2 * s.vocab * s.hidden * batch, s.head_weight_bytes)
        return self._slowest_stage(layer, head, depth)


def _check(batch: int, length: int) -> None:
    if batch < 1 or length < 1:
        raise ValueError(f"batch ({batch}) and length ({length}) must be >= 1")
