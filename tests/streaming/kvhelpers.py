"""Factories for the streaming tests: random KV caches, block tables, a tiny engine, and the
functions run by peer processes (spawned, so they live in an importable module)."""

from __future__ import annotations

import random

import torch

from kvflow.config import EngineConfig

from kvflow.engine.engine import LLMEngine
from kvflow.kv.cache import KVCache, KVLayout
from kvflow.kv.manager import KVCacheManager
from kvflow.model.config import ModelConfig
from kvflow.model.llama import LlamaModel
from kvflow.streaming.primitives import InStream, fetch
from kvflow.streaming.region import SeqRegion
from kvflow.streaming.scatter import KVSink, table_resolver

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)


def random_cache(layout: KVLayout, seed: int = 0) -> KVCache:
    cache = KVCache(layout)
    cache.data.copy_(torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed)).to(layout.dtype))
    return cache


def random_seqs(rng: random.Random, num_blocks: int, block_size: int, lengths: list[int], prefix: str = "r") -> list[SeqRegion]:
    """Sequences with shuffled (so partly adjacent, partly scattered) block tables."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    free.sort(key=lambda b: (rng.random() < 0.5, b))  # about half the blocks in ascending runs
    seqs = []
    for i, n in enumerate(lengths):
        nb = -(-n // block_size)
        blocks, free = free[:nb], free[nb:]
        start = rng.randrange(0, n)
        seqs.append(SeqRegion(f"{prefix}{i}", tuple(blocks), start, n))
    return seqs


def seq_kv(cache: KVCache, block_ids, token_start: int, token_end: int, layers: range) -> torch.Tensor:
    """[layers, 2, tokens, heads, dim] of one sequence, read through the cache's own API."""
    out = []
    for layer in layers:
        k, v = cache.read(layer, list(block_ids), token_end)
        out.append(torch.stack([k[token_start:], v[token_start:]]))
    return torch.stack(out)


def new_sink(layout: KVLayout) -> tuple[KVSink, dict[str, list[int]]]:
    tables: dict[str, list[int]] = {}
    mgr = KVCacheManager(layout.num_blocks, layout.block_size)
    return KVSink(KVCache(layout), table_resolver(tables, mgr.ensure)), tables


def tiny_model(num_layers: int = 4, seed: int = 0) -> LlamaModel:
    cfg = ModelConfig(**{**TINY, "num_layers": num_layers})
    g = torch.Generator().manual_seed(seed)
    D, I, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    sd = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, D, generator=g), "model.norm.weight": torch.ones(D), "lm_head.weight": torch.randn(cfg.vocab_size, D, generator=g) * 0.3}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (q, D), "self_attn.k_proj": (kv, D), "self_attn.v_proj": (kv, D), "self_attn.o_proj": (D, q), "mlp.gate_proj": (I, D), "mlp.up_proj": (I, D), "mlp.down_proj": (D, I)}
        for name, shape in shapes.items():
            sd[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.15
        sd[p + "input_layernorm.weight"] = torch.ones(D)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(D)
    return LlamaModel.from_state_dict(cfg, sd)


def tiny_engine(num_layers: int = 4, block_size: int = 4, num_blocks: int = 256) -> LLMEngine:
    return LLMEngine(tiny_model(num_layers), None, EngineConfig(block_size=block_size, num_kv_blocks=num_blocks))


# ---------------------------------------------------------------- peer processes
def receiver_process(kind: str, layout: KVLayout, conn) -> None:
    """Bind a TCP or shared-memory receiver and report its address; write every chunk that comes
    into a fresh cache until the parent says how many were sent (None: never, we get killed), then
    send back each request's KV and the mask of tokens received."""
    torch.set_num_threads(1)
    from kvflow.streaming.transports import ShmReceiver, TcpReceiver

    rx = TcpReceiver() if kind == "tcp" else ShmReceiver()
    conn.send(rx.address)
    inp = InStream(rx)
    sink, tables = new_sink(layout)
    got, total, told = 0, None, False
    while not told or (total is not None and got < total):
        if not told and conn.poll():
            total, told = conn.recv(), True
        try:
            with fetch(inp, 0.05) as chunk:
                sink.write(chunk)
            got += 1
        except TimeoutError:
            pass
    if total is None:
        conn.recv()  # wait to be killed
    layers = range(layout.layer_start, layout.layer_end)
    conn.send({rid: (seq_kv(sink.cache, t, 0, sink.received[rid].shape[2], layers).numpy().copy(), sink.received[rid].copy()) for rid, t in tables.items()})
    rx.close()


def stream_engine(engine: LLMEngine, sender) -> dict[str, tuple[int, ...]]:
    """Make `engine` send every token of KV it writes through the KV connector's `sender` (one
    destination stage 0 holding all layers): each step's new tokens of every request are planned as
    one hand-off and sent layer by layer. Returns the engine-side block tables seen, by request."""
    from kvflow.streaming.connector import HandoffRequest, plan_handoff

    runner, run = engine.runner, engine.runner.run
    bounds = [0, engine.model.cfg.num_layers]
    tables: dict[str, tuple[int, ...]] = {}

    def run_and_stream(out, *fed):
        reqs = []
        for s in out.seqs:
            blocks = tuple(s.request.block_ids)
            tables[s.request.request_id] = blocks
            reqs.append(HandoffRequest(s.request.request_id, s.start, s.end, s.end, blocks, blocks))
        sender.begin(reqs, plan_handoff(bounds, bounds, len(reqs)) if reqs else [])
        return run(out, *fed)

    runner.hook = sender.on_layer
    runner.run = run_and_stream
    return tables
