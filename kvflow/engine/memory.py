"""The KV cache's size from the GPU's memory (`EngineConfig.gpu_memory_utilization`, vLLM's flag).

The engine may use `utilization` x the device's total memory. Of that, the weights are already
resident when the cache is sized; the activations of the largest step the scheduler can form are
measured by running one (a prompt chunk of `max_num_batched_tokens` tokens over a scratch cache) and
reading the allocator's peak; a fixed reserve covers the CUDA graphs' pool and the allocator's
fragmentation. What remains is the KV cache. Memory that other processes hold on the device counts
against the budget too (it is not free), so a second engine on the same GPU gets what the first left.

Pipeline stages (`pipeline_pools`) measure the same way over their own layers, and the controller
sizes each pipeline's pool from what they all measured: see its docstring for GPUs shared by stages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kvflow.kv.cache import KVCache, KVLayout
from kvflow.model.batch import ForwardBatch
from kvflow.model.llama import LlamaModel

log = logging.getLogger(__name__)

RESERVE_BYTES = 512 << 20  # CUDA graphs' memory pool, the sampler's buffers, allocator slack (per process)
GIB = 2**30


@dataclass(frozen=True)
class DeviceMemory:
    total: int  # the device's memory
    free: int  # what no process holds now (torch.cuda.mem_get_info)
    activations: int  # the peak a step adds above what is resident


def kv_budget_bytes(mem: DeviceMemory, utilization: float, reserve: int = RESERVE_BYTES) -> int:
    """Bytes for the KV cache: utilization x total, less what is in use on the device (by anyone)
    and what a step needs on top (`utilization` as `EngineConfig` checked it); a clear error when
    nothing is left."""
    in_use = mem.total - mem.free
    budget = int(utilization * mem.total) - in_use - mem.activations - reserve
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} leaves no room for a KV cache: {utilization * mem.total / GIB:.1f} GiB "
            f"allowed, {in_use / GIB:.1f} GiB already in use on the device (weights and other processes), "
            f"{mem.activations / GIB:.2f} GiB for a step's activations, {reserve / GIB:.2f} GiB reserved; raise it, or "
            f"lower max_num_batched_tokens")
    return budget


@torch.inference_mode()
def measure(model: LlamaModel, block_size: int, tokens: int, dtype: torch.dtype) -> DeviceMemory:
    """The device's memory now, and the peak a prompt chunk of `tokens` tokens (the scheduler's token
    budget, the largest step it forms) adds above it, measured by running one over a scratch cache.
    `model` may hold a range of layers (a pipeline stage): a stage after the first takes its input
    hidden states (counted in the peak, as a step's input is), the last one computes the logits."""
    device = model.layers[0].input_norm.device
    if device.type != "cuda":
        raise ValueError("the KV cache is sized from GPU memory only on CUDA devices")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    blocks = -(-tokens // block_size)
    layers = (model.layer_start, model.layer_end)
    scratch = KVCache(KVLayout.for_model(model.cfg, blocks, block_size, layers, dtype=dtype), device)
    batch = ForwardBatch.of([(tokens, tokens, list(range(blocks)))], block_size, device)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    hidden = model.embed(ids) if model.is_first else torch.zeros(tokens, model.cfg.hidden_size, dtype=dtype, device=device)
    out = model.run_layers(hidden, batch, scratch)
    if model.is_last:
        model.logits(out, batch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - scratch.data.numel() * scratch.data.element_size()
    del scratch, ids, hidden, out
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    log.info("device memory: %.1f GiB total, %.1f GiB free, a %d-token step's peak %.2f GiB",
             total / GIB, free / GIB, tokens, peak / GIB)
    return DeviceMemory(total, free, peak)


@dataclass(frozen=True)
class StageMemory:
    """What one pipeline stage measured once its layers were loaded (`measure_stage`), sent to the
    controller in the start-up handshake as a dict."""

    device: str  # the GPU's UUID: the stages that report the same one share it
    total: int
    free: int  # free on the device when read, after this stage's step measurement
    read_at: float  # when (time.monotonic(): stages that share a GPU share a host, hence this clock)
    activations: int  # its step's peak above what it holds
    block_bytes: int  # one KV block of its layers


def measure_stage(model: LlamaModel, block_size: int, tokens: int, dtype: torch.dtype) -> StageMemory:
    """`measure` over a stage's layers, with what the controller needs to size the pools: the GPU's
    identity, when free memory was read, and the bytes of one block of the stage's layers."""
    mem = measure(model, block_size, tokens, dtype)
    device = model.layers[0].input_norm.device
    layout = KVLayout.for_model(model.cfg, 1, block_size, (model.layer_start, model.layer_end), dtype=dtype)
    return StageMemory(str(torch.cuda.get_device_properties(device).uuid), mem.total, mem.free, time.monotonic(),
                       mem.activations, layout.bytes_per_block)


def pipeline_pools(stages: Mapping[str, tuple[str, StageMemory]], utilization: float,
                   reserve: int = RESERVE_BYTES) -> dict[str, int]:
    """Each pipeline's blocks per stage's device from its stages' measurements (stage name ->
    (pipeline name, `StageMemory`)): the minimum over its stages, since the scheduler accounts one
    block id space per pipeline and every stage holds the same block ids for its own layers.

    Stages that share a GPU (the local launcher puts several on one when there are more stages than
    GPUs) share its fraction. They load and measure at the same time, each reading free memory after
    its own measurement and then waiting for the controller, so the latest reading on a GPU (by
    `read_at`) was taken when every stage there had loaded its weights and freed its scratch: it
    counts all their weights and CUDA contexts, and whatever other processes hold. What it leaves of
    `utilization` x the GPU, less every stage's step activations and reserve, is the GPU's KV room,
    shared among its stages in proportion to their bytes per block: each gets the same number of
    blocks, room // (the sum of their bytes per block), as `num_kv_blocks` gives every pipeline. This
    rather than measuring the stages in turn: they load in parallel, and a stage's budget never
    depends on the order it happened to measure in. A GPU with no room for one block of every stage
    there is an error naming them."""
    on: dict[str, list[str]] = {}
    for name, (_, m) in stages.items():
        on.setdefault(m.device, []).append(name)
    blocks: dict[str, int] = {}  # GPU -> blocks of each stage on it
    for device, names in on.items():
        mems = [stages[n][1] for n in names]
        latest = max(mems, key=lambda m: m.read_at)
        where = f"stage{'s' * (len(names) > 1)} {', '.join(sorted(names))} on GPU {device}"
        try:
            room = kv_budget_bytes(DeviceMemory(latest.total, latest.free, sum(m.activations for m in mems)),
                                   utilization, reserve * len(mems))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        per_block = sum(m.block_bytes for m in mems)
        if room < per_block:
            raise ValueError(f"{where}: gpu_memory_utilization {utilization} leaves {room / GIB:.3f} GiB for KV, less "
                             f"than one block of their layers ({per_block / 2**20:.2f} MiB); raise it, or lower "
                             f"max_num_batched_tokens")
        blocks[device] = room // per_block
    pools: dict[str, int] = {}
    for name, (pipeline, m) in stages.items():
        pools[pipeline] = min(pools.get(pipeline, blocks[m.device]), blocks[m.device])
    return pools


def check_pool_fits(mem: StageMemory, utilization: float, blocks: int, reserve: int = RESERVE_BYTES) -> None:
    """A replacement stage joins a live pipeline, whose pool cannot change: its `blocks` on this
    device must fit what `utilization` leaves now (other stages' caches and other processes in use)."""
    room = int(utilization * mem.total) - (mem.total - mem.free) - mem.activations - reserve  # (`kv_budget_bytes`'s)
    if blocks * mem.block_bytes > room:
        raise ValueError(f"the pipeline's pool of {blocks} blocks ({blocks * mem.block_bytes / GIB:.2f} GiB of this "
                         f"stage's KV) does not fit on its GPU: gpu_memory_utilization {utilization} leaves "
                         f"{max(room, 0) / GIB:.2f} GiB now, and a replacement cannot change a live pipeline's pool; free "
                         f"memory on the GPU (or restart the server to size the pools again)")
