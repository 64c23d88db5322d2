"""stream_out between pipelines of every depth pair 1..4 with unequal microbatches; each destination
stage expects exactly its part of the plan and gathers it (what the KV connector's receiver does)."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.kv.cache import KVCache, KVLayout
from kvflow.streaming.primitives import InStream, OutStream
from kvflow.streaming.scatter import gather
from kvflow.streaming.topology import PipelineTopology, plan_transfers, stream_out
from kvflow.streaming.transports import InprocChannel
from kvhelpers import new_sink, random_seqs, seq_kv

HEADS, DIM, BS = 2, 4, 4


def receive_planned(stage, plan, segments, inp, sink, microbatch) -> None:
    """Expect this destination stage's part of the plan, then gather until one microbatch is in."""
    mine = [t for t in plan if t.dst == stage]
    for t in mine:
        for r in segments[t.request_start:t.request_end]:
            sink.expect(r.request_id, t.layer_start, t.layer_end, r.token_start, r.token_end)
    wanted = {r.request_id for t in mine if t.dst_microbatch == microbatch for r in segments[t.request_start:t.request_end]}
    gather(inp, sink, timeout=1, until=lambda: sink.complete_for(wanted))


def run_streaming(src: PipelineTopology, dst: PipelineTopology, lengths: list[int], seed: int) -> None:
    """Each source stage holds its layers of every request (own block tables); each destination
    stage must end up with exactly its layers of its requests, equal to the source's bytes."""
    rng = random.Random(seed)
    nblocks = sum(-(-n // BS) for n in lengths) + 3
    src_caches, src_seqs = [], []
    for s in range(src.depth):
        a, b = src.stage_layers(s)
        cache = KVCache(KVLayout(nblocks, BS, HEADS, DIM, a, b))
        cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(seed * 10 + s)))
        src_caches.append(cache)
        seqs = random_seqs(rng, nblocks, BS, lengths)  # own block tables, same token ranges as stage 0
        src_seqs.append([replace(q, token_start=src_seqs[0][i].token_start) for i, q in enumerate(seqs)] if src_seqs else seqs)
    plan = plan_transfers(src, dst)
    channels = [InprocChannel(window=10_000) for _ in range(dst.depth)]
    for s in range(src.depth):  # every source stage streams into every destination's one receiver
        outs = {d: OutStream(channels[d].sender) for d in range(dst.depth)}
        stream_out(s, src_caches[s], src_seqs[s], plan, outs)
    segments = [q.segment for q in src_seqs[0]]
    for d in range(dst.depth):
        a, b = dst.stage_layers(d)
        sink, tables = new_sink(KVLayout(nblocks, BS, HEADS, DIM, a, b))
        inp = InStream(channels[d].receiver)
        for mb in range(len(dst.microbatch_sizes)):  # microbatch by microbatch, as a token stage would
            receive_planned(d, plan, segments, inp, sink, mb)
            r0, r1 = dst.microbatch_requests(mb)
            assert sink.complete_for([q.request_id for q in segments[r0:r1]])
        assert sink.complete
        assert set(tables) == {q.request_id for q in src_seqs[0]}
        with pytest.raises(TimeoutError):  # nothing left over for this stage
            inp.receiver.recv(0.01)
        for layer in range(a, b):
            s = next(i for i in range(src.depth) if src.stage_layers(i)[0] <= layer < src.stage_layers(i)[1])
            for q in src_seqs[s]:
                want = seq_kv(src_caches[s], q.block_ids, q.token_start, q.token_end, range(layer, layer + 1))
                got = seq_kv(sink.cache, tables[q.request_id], q.token_start, q.token_end, range(layer, layer + 1))
                assert torch.equal(want, got), (layer, q.request_id)


def split(total: int, parts: int, rng: random.Random) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, total]))


@pytest.mark.parametrize("src_depth, dst_depth", list(itertools.product(range(1, 5), range(1, 5))))
def test_every_depth_pair(src_depth, dst_depth):
    rng = random.Random(src_depth * 7 + dst_depth)
    src = PipelineTopology.even(6, src_depth, split(6, 3, rng))
    dst = PipelineTopology.even(6, dst_depth, split(6, 2, rng))
    run_streaming(src, dst, [rng.randint(1, 13) for _ in range(6)], seed=src_depth * 4 + dst_depth)


@st.composite
def topologies(draw):
    num_layers = draw(st.integers(4, 9))
    num_requests = draw(st.integers(1, 7))

    def side():
        depth = draw(st.integers(1, 4))
        bounds = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=depth - 1, max_size=depth - 1)))
        nmb = draw(st.integers(1, num_requests))
        cuts = sorted(draw(st.sets(st.integers(1, num_requests - 1), min_size=nmb - 1, max_size=nmb - 1))) if num_requests > 1 else []
        sizes = tuple(b - a for a, b in zip([0, *cuts], [*cuts, num_requests]))
        return PipelineTopology((0, *bounds, num_layers), sizes)

    src, dst = side(), side()
    lengths = draw(st.lists(st.integers(1, 11), min_size=num_requests, max_size=num_requests))
    return src, dst, lengths, draw(st.integers(0, 1000))


@settings(max_examples=40, deadline=None)
@given(topologies())
def test_repartitioning_property(case):
    src, dst, lengths, seed = case
    plan = plan_transfers(src, dst)
    cover = {}
    for t in plan:  # the plan covers every (layer, request) exactly once, from the right stages
        assert src.stage_layers(t.src)[0] <= t.layer_start < t.layer_end <= src.stage_layers(t.src)[1]
        assert dst.stage_layers(t.dst)[0] <= t.layer_start and t.layer_end <= dst.stage_layers(t.dst)[1]
        for key in itertools.product(range(t.layer_start, t.layer_end), range(t.request_start, t.request_end)):
            assert key not in cover
            cover[key] = t
    assert len(cover) == src.num_layers * src.num_requests
    run_streaming(src, dst, lengths, seed)


def test_mismatched_topologies_are_refused():
    with pytest.raises(ValueError, match="layers"):
        plan_transfers(PipelineTopology.even(4, 2, (2,)), PipelineTopology.even(6, 2, (2,)))
    with pytest.raises(ValueError, match="requests"):
        plan_transfers(PipelineTopology.even(4, 2, (2,)), PipelineTopology.even(4, 2, (1, 2)))
    with pytest.raises(ValueError):
        PipelineTopology((0, 3, 3), (1,))
    with pytest.raises(ValueError):
        PipelineTopology.even(3, 4, (1,))
