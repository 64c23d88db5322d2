"""What a pipeline stage builds from its `Setup` once its layers are loaded (`Worker._setup`): its
KV cache (on its device, or with microbatch swapping in host memory with regions of it on the
device), the CUDA graphs of its decode steps (none for a prompt stage), the replica it holds of the
previous stage's KV, the ring its input hidden states arrive in and its prefix cache's lower tiers.
Sized from GPU memory, a stage first measures what its layers leave (`measure`; the controller sizes
the pools from every stage's measurement, `engine.memory.pipeline_pools`)."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import NamedTuple

import torch

from kvflow.config import EngineConfig, WorkerSpec
from kvflow.engine.memory import StageMemory, measure_stage
from kvflow.kv.cache import KVCache, KVLayout
from kvflow.model import cuda_graphs
from kvflow.model.config import ModelConfig
from kvflow.model.llama import LlamaModel
from kvflow.streaming.hidden_ring import HiddenRing, open_ring
from kvflow.streaming.swapper import Swapper
from kvflow.streaming.tier_store import TierStore
from kvflow.worker.replication import held_replica


class StageCaches(NamedTuple):
    cache: KVCache  # the pool's block ids for this stage's layers
    compute_cache: KVCache  # what steps compute in: `cache`, or its device regions when swapping
    swapper: Swapper | None
    graphs: cuda_graphs.DecodeGraphs | None  # decode steps replayed from CUDA graphs (the stage's own layers)
    replica: KVCache | None  # the previous stage's KV, replicated here
    hidden_in: HiddenRing | None  # where its input hidden states arrive (a stage after the first, local)
    tiers: TierStore | None  # the prefix cache's host and disk slots of this stage's layers


def measure(model: LlamaModel, ecfg: EngineConfig, mc: ModelConfig) -> StageMemory:
    """The GPU's memory with this stage's layers loaded and the peak of its largest step (the token
    budget's, as the engine measures its own)."""
    tokens = min(ecfg.scheduler.max_num_batched_tokens, ecfg.model_len(mc.max_position_embeddings))
    return measure_stage(model, ecfg.block_size, tokens, ecfg.torch_dtype)


def build(spec: WorkerSpec, ecfg: EngineConfig, mc: ModelConfig, model: LlamaModel, name: str) -> StageCaches:
    device = torch.device(ecfg.device)
    layers = (spec.layer_start, spec.layer_end)
    nblocks = spec.pool_blocks or ecfg.num_kv_blocks  # the block ids the pipeline's scheduler accounts
    layout = KVLayout.for_model(mc, nblocks, ecfg.block_size, layers, dtype=ecfg.torch_dtype)
    swapper = None
    if spec.swap_regions:  # microbatch swapping: the pool in host memory, regions of it on the device
        cache = KVCache(layout, "cpu", pin_memory=device.type == "cuda")
        compute_cache = KVCache(replace(layout, num_blocks=spec.swap_regions * spec.swap_region_blocks), ecfg.device)
        swapper = Swapper(cache, compute_cache, spec.swap_regions)
    else:
        cache = compute_cache = KVCache(layout, ecfg.device)
    graphs = None
    if not ecfg.enforce_eager and spec.role != "prompt":  # (a prompt stage runs no decode step)
        # a stage holding every layer decodes ahead on the device as the engine does (`worker.compute`)
        ahead = ecfg.decode_ahead and model.is_first and model.is_last and swapper is None
        graphs = cuda_graphs.capture(model, compute_cache, ecfg.scheduler.max_num_seqs,
                                     ecfg.model_len(mc.max_position_embeddings), float_logits=False, ahead=ahead)
    replica = None
    if spec.replica_layer_start >= 0:  # a host-memory replica of the previous stage's KV
        rl = KVLayout.for_model(mc, nblocks, ecfg.block_size, (spec.replica_layer_start, spec.replica_layer_end),
                                dtype=ecfg.torch_dtype)
        replica = held_replica(rl, spec.replica_shm, name)
    tiers = None
    if spec.host_kv_slots:
        path = os.path.join(ecfg.disk_kv_path, spec.name) if ecfg.disk_kv_path else None
        tiers = TierStore(cache, spec.host_kv_slots, spec.disk_kv_slots, path)
    return StageCaches(cache, compute_cache, swapper, graphs, replica, open_ring(spec.hidden_shm, device, name), tiers)
