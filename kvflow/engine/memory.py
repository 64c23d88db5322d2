"""The KV cache's size from the GPU's memory (`EngineConfig.gpu_memory_utilization`, vLLM's flag).

The engine may use `utilization` x the device's total memory. Of that, the weights are already
resident when the cache is sized; the activations of the largest step the scheduler can form are
measured by running one (a prompt chunk of `max_num_batched_tokens` tokens over a scratch cache) and
reading the allocator's peak; a fixed reserve covers the CUDA graphs' pool and the allocator's
fragmentation. What remains is the KV cache. Memory that other processes hold on the device counts
against the budget too (it is not free), so a second engine on the same GPU gets what the first left.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvflow.kv.cache import KVCache, KVLayout
from kvflow.model.batch import ForwardBatch
from kvflow.model.llama import LlamaModel

log = logging.getLogger(__name__)

RESERVE_BYTES = 512 << 20  # CUDA graphs' memory pool, the sampler's buffers, allocator slack


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
        gib = 2**30
        raise ValueError(
            f"gpu_memory_utilization {utilization} leaves no room for a KV cache: {utilization * mem.total / gib:.1f} GiB "
            f"allowed, {in_use / gib:.1f} GiB already in use on the device (weights and other processes), "
            f"{mem.activations / gib:.2f} GiB for a step's activations, {reserve / gib:.2f} GiB reserved; raise it, or "
            f"lower max_num_batched_tokens")
    return budget


@torch.inference_mode()
def measure(model: LlamaModel, block_size: int, tokens: int, dtype: torch.dtype) -> DeviceMemory:
    """The device's memory now, and the peak a prompt chunk of `tokens` tokens (the scheduler's token
    budget, the largest step it forms) adds above it, measured by running one over a scratch cache."""
    device = model.layers[0].input_norm.device
    if device.type != "cuda":
        raise ValueError("the KV cache is sized from GPU memory only on CUDA devices")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    blocks = -(-tokens // block_size)
    scratch = KVCache(KVLayout.for_model(model.cfg, blocks, block_size, dtype=dtype), device)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    model.forward(ids, ForwardBatch.of([(tokens, tokens, list(range(blocks)))], block_size, device), scratch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - scratch.data.numel() * scratch.data.element_size()
    del scratch, ids
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    log.info("device memory: %.1f GiB total, %.1f GiB free, a %d-token step's peak %.2f GiB",
             total / 2**30, free / 2**30, tokens, peak / 2**30)
    return DeviceMemory(total, free, peak)
