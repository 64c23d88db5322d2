"""The one scheduling core, driven by hand: in-flight batches, deltas, roles and the microbatch policy."""

from __future__ import annotations

import itertools

import pytest

from kvflow.kv.manager import KVCacheManager
from kvflow.sched.admission import InvalidRequest, Limits, validate
from kvflow.sched.executor import PipelineState
from kvflow.sched.handoff import Handoff, KVStream
from kvflow.sched.request import Request, RequestStatus
from kvflow.sched.sampling import SamplingParams
from kvflow.sched.scheduler import ScheduledSeq, Scheduler, SchedulerConfig


_prompts = itertools.count(1)


def req(rid: str, n_prompt: int, max_tokens: int = 4) -> Request:
    """A request whose prompt shares no block with any other's (prefix caching: tests/test_prefix_cache.py)."""
    base = 1000 * next(_prompts)
    return Request(rid, list(range(base, base + n_prompt)), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def sampled_for(out, tok: int = 7) -> dict[str, int]:
    return {s.request.request_id: tok for s in out.seqs if s.completes_prompt}


def test_a_request_is_in_at_most_one_batch_in_flight():
    s = Scheduler(SchedulerConfig(max_in_flight=2), KVCacheManager(64, 4), 256)
    a, b = req("a", 5), req("b", 6)
    s.add(a)
    first = s.schedule()
    s.add(b)
    second = s.schedule()  # a is in flight: only b
    assert [x.request.request_id for x in first.seqs] == ["a"] and [x.request.request_id for x in second.seqs] == ["b"]
    assert s.schedule().is_empty and s.num_batches_in_flight == 2
    s.update(second, sampled_for(second))  # batches may come back out of order
    third = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens, x.start) for x in third.seqs] == [("b", 1, 6)]
    s.update(first, sampled_for(first))
    assert a.output_token_ids == [7] and b.output_token_ids == [7]


def test_token_ids_are_the_prompt_then_the_output_without_a_copy():
    """`Request.token_ids` reads the request's own two lists: it indexes and slices like their
    concatenation (what the model consumes) and sees every token as it is appended."""
    prompt = [5, 6, 7]
    r = Request("a", prompt, SamplingParams(max_tokens=4))
    r.append_token(8, 100)
    r.extend_tokens([9, 9])
    whole = prompt + [8, 9, 9]
    assert r.token_ids.prompt is prompt and r.num_tokens == len(r.token_ids) == 6 and r.token_ids == whole
    for a, b, step in itertools.product([None, -7, -4, 0, 2, 3, 4, 6, 9], [None, -7, -1, 0, 1, 3, 5, 6, 9], [None, 1, 2, -1]):
        assert r.token_ids[a:b:step] == whole[a:b:step], (a, b, step)
    assert [r.token_ids[i] for i in range(-6, 6)] == whole[-6:] + whole
    with pytest.raises(IndexError):
        r.token_ids[6]
    assert prompt == [5, 6, 7]  # the caller's list is never written


def test_block_tables_travel_as_deltas():
    s = Scheduler(SchedulerConfig(), KVCacheManager(64, 4), 256)
    r = req("r", 7, max_tokens=8)
    s.add(r)
    out = s.schedule()
    assert out.seqs[0].full_table and out.seqs[0].new_block_ids == tuple(r.block_ids) and len(r.block_ids) == 2
    s.update(out, sampled_for(out))  # 8 tokens: the 8th fits the 2 blocks
    out = s.schedule()
    assert not out.seqs[0].full_table and out.seqs[0].new_block_ids == ()
    s.update(out, sampled_for(out))  # 9 tokens: a third block
    out = s.schedule()
    assert out.seqs[0].new_block_ids == (r.block_ids[2],) and not out.seqs[0].full_table


def test_chunked_prefill_and_preemption_report_freed_requests():
    cfg = SchedulerConfig(max_num_batched_tokens=8, prefill_chunk_size=8, reserve_kv=False)  # admit greedily, preempt
    s = Scheduler(cfg, KVCacheManager(6, 4), 256)
    a, b = req("a", 12, max_tokens=6), req("b", 8, max_tokens=6)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in out.seqs] == [("a", 8)]
    s.update(out, {})
    out = s.schedule()  # the rest of a's prompt, and b's first chunk in the remaining budget
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in out.seqs] == [("a", 8, 4), ("b", 0, 4)]
    s.update(out, sampled_for(out))
    while not out.preempted:  # a grows until a block is missing: the newest (b) is preempted
        out = s.schedule()
        s.update(out, sampled_for(out))
    assert out.preempted == [b] and b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.waiting[0] is b and not b.block_ids
    assert "b" in out.freed  # the executor is told, with this very batch, to drop b's mirrored table


def test_reserve_kv_admits_only_what_can_finish_so_nothing_is_preempted():
    """The same two requests as above with the default reservation: b (2 + 4 blocks of prompt + max_tokens)
    waits while a holds its 5, is admitted when a finishes, and neither is ever preempted."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, prefill_chunk_size=8), KVCacheManager(6, 4), 256)
    a, b = req("a", 12, max_tokens=6), req("b", 8, max_tokens=6)
    s.add(a)
    s.add(b)
    log = []
    while s.has_unfinished:
        out = s.schedule()
        assert not out.preempted
        log.append([(x.request.request_id, x.start, x.num_new_tokens) for x in out.seqs])
        s.update(out, sampled_for(out))
    assert log[:2] == [[("a", 0, 8)], [("a", 8, 4)]]  # b's first chunk would fit, but not b at full length
    first_b = next(i for i, batch in enumerate(log) if any(rid == "b" for rid, _, _ in batch))
    assert a.finish_reason == "length" and all(rid == "a" for batch in log[:first_b] for rid, _, _ in batch)
    assert log[first_b] == [("b", 0, 8)] and b.finish_reason == "length" and a.num_preemptions == b.num_preemptions == 0


def test_reserve_kv_counts_the_running_requests_whole_length():
    """Up to `num_blocks` of prompt + max_tokens run at once: 3 requests of 2 blocks each fit 6 blocks, a 4th waits."""
    s = Scheduler(SchedulerConfig(), KVCacheManager(6, 4), 256)
    reqs = [req(f"r{i}", 4, max_tokens=4) for i in range(4)]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert [x.request.request_id for x in out.seqs] == ["r0", "r1", "r2"] and list(s.waiting) == [reqs[3]]
    assert SchedulerConfig(reserve_kv=False) != SchedulerConfig()
    greedy = Scheduler(SchedulerConfig(reserve_kv=False), KVCacheManager(6, 4), 256)
    for r in [req(f"g{i}", 4, max_tokens=4) for i in range(4)]:
        greedy.add(r)
    assert len(greedy.schedule().seqs) == 4  # without the reservation all four start (one block each for now)
    with pytest.raises(ValueError, match="reserve_kv"):
        SchedulerConfig(reserve_kv=1)


def test_prompt_role_hands_off_and_never_preempts():
    prompt_kv = KVCacheManager(8, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=4, prefill_chunk_size=4), prompt_kv, 256, role="prompt")
    r = req("r", 10)
    s.add(r)
    out = s.schedule()
    assert len(r.block_ids) == 3  # the whole prompt from admission on
    s.update(out, {})
    out = s.schedule()
    s.update(out, {})
    out = s.schedule()
    assert out.seqs[0].completes_prompt
    s.update(out, {"r": 42})
    assert s.take_handoffs() == [r] and not s.running and prompt_kv.num_free_blocks == 8
    assert r.output_token_ids == [42] and not r.is_finished


def test_admit_hook_can_refuse():
    s = Scheduler(SchedulerConfig(), KVCacheManager(64, 4), 256, role="prompt", admit_hook=lambda r: r.request_id != "no")
    s.add(req("no", 3))
    s.add(req("yes", 3))
    assert s.schedule().is_empty and len(s.waiting) == 2  # FCFS: the head blocks the queue


def test_token_role_decodes_and_returns_preempted_requests():
    kv = KVCacheManager(3, 4)
    s = Scheduler(SchedulerConfig(), kv, 256, role="token")
    a, b = req("a", 4, max_tokens=10), req("b", 3, max_tokens=10)
    for r, tok in ((a, 5), (b, 6)):
        r.append_token(tok, 256)
        kv.ensure(r.block_ids, r.num_tokens - 1)
        s.add_running(r)
    out = s.schedule()
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.full_table) for x in out.seqs] == [("a", 4, 1, True), ("b", 3, 1, True)]
    s.update(out, sampled_for(out))
    s.add(req("c", 3))  # a token scheduler never prefills
    while True:
        out = s.schedule()
        if out.preempted:
            break
        assert all(x.request.request_id in ("a", "b") for x in out.seqs)
        s.update(out, sampled_for(out))
    assert out.preempted == [b] and b not in s.waiting  # returned to the executor for recompute


def test_microbatch_policy_keeps_fixed_groups_and_reserves_max_tokens():
    s = Scheduler(SchedulerConfig(policy="microbatch", microbatch_size=2, max_in_flight=2), KVCacheManager(64, 4), 256)
    rs = [req(f"r{i}", 4, max_tokens=[1, 3, 2, 2, 2][i]) for i in range(5)]
    for r in rs:
        s.add(r)
    g1, g2 = s.schedule(), s.schedule()
    assert [x.request.request_id for x in g1.seqs] == ["r0", "r1"] and [x.request.request_id for x in g2.seqs] == ["r2", "r3"]
    assert len(rs[0].block_ids) == 2  # 4 + 1 tokens reserved up front
    assert s.schedule().is_empty  # both slots busy
    s.update(g1, sampled_for(g1))  # r0 finishes; r1 goes on in the same microbatch
    again = s.schedule()
    assert [x.request.request_id for x in again.seqs] == ["r1"]
    s.update(again, sampled_for(again))
    s.update(g2, sampled_for(g2))
    third = s.schedule()  # r2/r3 decode; r4 waits for a whole slot
    assert [x.request.request_id for x in third.seqs] == ["r2", "r3"]
    s.update(third, sampled_for(third))  # r2, r3 done: their slot frees
    last = s.schedule()
    assert [x.request.request_id for x in last.seqs] == ["r1"]
    s.update(last, sampled_for(last))
    assert [x.request.request_id for x in s.schedule().seqs] == ["r4"]


def test_abort_of_an_in_flight_request_frees_when_its_batch_returns():
    kv = KVCacheManager(16, 4)
    s = Scheduler(SchedulerConfig(), kv, 256)
    r = req("r", 6)
    s.add(r)
    out = s.schedule()
    s.abort(r)
    assert r.is_finished and kv.num_free_blocks == 14  # still being written by the batch in flight
    assert s.update(out, {"r": 1}) == [r] and kv.num_free_blocks == 16 and r.output_token_ids == []


def test_rewind_resumes_from_the_replica_without_sampling_again():
    kv = KVCacheManager(64, 4)
    s = Scheduler(SchedulerConfig(max_in_flight=2), kv, 256)
    a, b, c = req("a", 9, max_tokens=8), req("b", 5, max_tokens=8), req("c", 3)
    for r in (a, b):
        s.add(r)
    for _ in range(3):  # prefill + 2 decode steps: 11 and 7 tokens computed, 3 sampled each
        out = s.schedule()
        s.update(out, sampled_for(out))
    s.add(c)
    lost = s.schedule()  # in flight when the stage dies: its result never comes
    s.abort(c)
    tables = {r.request_id: list(r.block_ids) for r in (a, b)}
    gone = s.rewind({"a": 6, "b": 50})  # the replica holds a's first 6 tokens; b's beyond its progress
    assert gone == [c] and c.block_ids == [] and s.num_batches_in_flight == 0 and lost.seqs
    assert (a.num_computed_tokens, b.num_computed_tokens) == (6, 7)
    out = s.schedule()  # the rest of a is recomputed as one chunk, whole tables re-sent; b decodes
    got = {x.request.request_id: (x.start, x.num_new_tokens, x.full_table, x.new_block_ids) for x in out.seqs}
    assert got == {"a": (6, 6, True, tuple(tables["a"])), "b": (7, 1, True, tuple(tables["b"]))}
    s.update(out, sampled_for(out, 9))
    assert a.output_token_ids == [7, 7, 7, 9] and b.output_token_ids == [7, 7, 7, 9]  # one new token each


@pytest.mark.parametrize("prompt, max_tokens, match, field, code", [
    ([], 4, "empty", "prompt", None), ([5, 999], 4, "out of range", "prompt", None),
    (list(range(1, 61)), 4, "no room to generate", "prompt", "context_length_exceeded"),
    (list(range(1, 40)), 30, "exceeds this model's maximum context", "max_tokens", "context_length_exceeded"),
    (list(range(1, 40)), 10, "KV blocks", None, None),
])
def test_validate_names_the_problem_and_the_field(prompt, max_tokens, match, field, code):
    r = Request("x", prompt, SamplingParams(max_tokens=max_tokens))
    with pytest.raises(InvalidRequest, match=match) as e:
        validate(r, Limits(60, 100), [KVCacheManager(64, 4), KVCacheManager(10, 4)])
    assert (e.value.field, e.value.code) == (field, code)
    assert str(e.value).startswith(field or "the request")


def test_sampling_params_name_the_field():
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(top_p=2)
    assert (e.value.field, e.value.reason, str(e.value)) == ("top_p", "must be in (0, 1], got 2", "top_p must be in (0, 1], got 2")
    assert e.value.about("nucleus").message == "nucleus must be in (0, 1], got 2"


def test_config_is_validated():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lottery")
    with pytest.raises(ValueError, match="microbatch_size"):
        SchedulerConfig(policy="microbatch")
    with pytest.raises(ValueError, match="max_in_flight"):
        SchedulerConfig(max_in_flight=0)


def token_side(blocks: int, config: SchedulerConfig, microbatch: int) -> PipelineState:
    """A depth-1 token pipeline as the executor keeps it."""
    kv = KVCacheManager(blocks, 4)
    return PipelineState("token", 1, microbatch, Scheduler(config, kv, 64, "token"), kv)


def test_handoff_joins_after_kv_and_first_token_and_frees_each_reservation_once():
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=64)
    a, b = token_side(8, config, 2), token_side(8, config, 2)
    h = Handoff([a, b])
    reqs = [req(f"r{i}", 6) for i in range(3)]
    assert all(h.reserve(r) for r in reqs)
    # a token microbatch's worth (2) to one pipeline, then to the one with the most free blocks
    assert [h.target(r.request_id) for r in reqs] == [a, a, b]
    assert a.kv_manager.num_free_blocks == 8 - 2 * 2 and b.kv_manager.num_free_blocks == 8 - 2

    # the prompt pass is sent: r0's whole prompt (6 tokens) streams into its reservation, in two parts
    streams = h.send([ScheduledSeq(reqs[0], 6, 0, (), True)], ["stage-0", "stage-1"])
    assert streams == [KVStream("r0", 0, 6, 6, h.table("r0"), 0)]
    assert h.sampled([reqs[0]]) == []  # parked: its KV is not all there
    assert h.kv_arrived(["r0"], "stage-0") == [] and h.kv_arrived(["r0"], "nope") == []
    assert h.kv_arrived(["r0"], "stage-1") == [reqs[0]]
    table = list(h.table("r0"))
    assert h.join(reqs[0]) is a and reqs[0] in a.sched.running and reqs[0].block_ids == table and len(table) == 2

    # finished at its first token while its KV is on the way: freed only once the KV is in
    h.send([ScheduledSeq(reqs[1], 6, 0, (), True)], ["stage-0"])
    reqs[1].finish("length")
    assert h.settle(reqs[1]) is None and a.kv_manager.num_free_blocks == 4
    assert h.kv_arrived(["r1"], "stage-0") == [reqs[1]]
    assert h.settle(reqs[1]) is a and a.kv_manager.num_free_blocks == 6
    assert h.settle(reqs[1]) is None and a.kv_manager.num_free_blocks == 6  # never twice

    # a failure: the unfinished request waiting for its KV comes back; its reservation is freed
    h.send([ScheduledSeq(reqs[2], 6, 0, (), True)], ["stage-0"])
    assert h.sampled([reqs[2]]) == []
    assert h.num_waiting == 1
    assert h.drop_in_flight() == [reqs[2]] and b.kv_manager.num_free_blocks == 8 and h.num_waiting == 0


def test_microbatch_handoff_reserves_whole_requests_and_frees_what_waits_for_a_microbatch():
    # A token microbatch never grows its tables (the policy reserves a request's whole KV up front),
    # so the hand-off reserves prompt + max_tokens; a request that waits in the ready queue holds
    # its blocks itself, and gives them back when it finishes there or a failure resets the hand-off.
    tp = token_side(16, SchedulerConfig(policy="microbatch", microbatch_size=1, max_in_flight=1), 1)
    kv, h = tp.kv_manager, Handoff([tp])
    a, b = req("a", 6, max_tokens=7), req("b", 3, max_tokens=2)
    assert h.reserve(a) and h.reserve(b)
    assert len(h.table("a")) == 4 and len(h.table("b")) == 2  # ceil(13 / 4), ceil(5 / 4)
    h.join(a), h.join(b)
    assert list(tp.ready) == [a, b] and kv.num_free_blocks == 10
    b.finish("abort")
    assert h.settle(b) is tp and kv.num_free_blocks == 12 and list(tp.ready) == [a]
    assert h.drop_in_flight() == [a] and kv.num_free_blocks == 16 and not tp.ready


def test_serve_flags_reach_the_scheduler_config():
    from kvflow.cli.main import build_parser
    from kvflow.cli.serve import _scheduler_config

    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "128", "--prefill-chunk-size", "64",
                                      "--no-reserve-kv", "--max-num-seqs", "8"])
    assert _scheduler_config(args) == SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, prefill_chunk_size=64,
                                                      reserve_kv=False)
    defaults = _scheduler_config(build_parser().parse_args(["serve"]))
    assert (defaults.max_num_batched_tokens, defaults.prefill_chunk_size, defaults.reserve_kv) == (2048 + 64, 2048, True)
    # the default budget follows the chunk and the concurrency: a whole chunk beside every decode
    assert _scheduler_config(build_parser().parse_args(["serve", "--prefill-chunk-size", "100", "--max-num-seqs", "10"])
                             ).max_num_batched_tokens == 110


def test_serve_block_size_sets_the_engine_config_and_the_pipelines_block_count(tiny_ckpt_dir):
    # --block-size (default: 128 on CPU) reaches the EngineConfig in every mode, and a pipeline's
    # --kv-cache-gb is turned into blocks of that size (it was computed for 16-token blocks whatever
    # the block size)
    from kvflow.cli.main import build_parser
    from kvflow.cli.serve import _engine_config
    from kvflow.kv.cache import KVLayout
    from kvflow.model.loader import load_config

    mc, _ = load_config(str(tiny_ckpt_dir))
    base = ["serve", "--model", str(tiny_ckpt_dir), "--dtype", "float32", "--kv-cache-gb", "0.01"]
    for extra, size in (([], 128), (["--block-size", "8"], 8)):
        engine = _engine_config(build_parser().parse_args(base + ["--mode", "engine"] + extra))
        assert (engine.block_size, engine.num_kv_blocks, engine.kv_cache_memory_gb) == (size, None, 0.01)
        pipe = _engine_config(build_parser().parse_args(base + ["--mode", "colocated"] + extra))
        per_block = KVLayout.for_model(mc, 1, size, dtype=pipe.torch_dtype).bytes_per_block
        assert (pipe.block_size, pipe.num_kv_blocks) == (size, int(0.01 * 2**30 // per_block))


def test_a_prompt_that_fits_a_chunk_is_not_split_by_the_decodes():
    # 3 requests decoding, then a 256-token prompt: with the default budget (chunk + max_num_seqs) it
    # runs whole beside the 3 decode tokens; a budget of just the chunk would leave a 3-token tail step.
    for budget, chunks in ((None, [256]), (256, [253, 3])):
        s = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), KVCacheManager(256, 16), 2048)
        olds = [req(f"d{i}", 8, 50) for i in range(3)]
        for r in olds:
            s.add(r)
        out = s.schedule()
        s.update(out, {r.request_id: 1 for r in olds})
        new = req("p", 256, 4)
        s.add(new)
        got = []
        while not got or sum(got) < 256:
            out = s.schedule()
            got += [x.num_new_tokens for x in out.seqs if x.request is new]
            assert sum(x.num_new_tokens for x in out.seqs if x.request is not new) == 3  # the decodes ran too
            s.update(out, {r.request_id: 1 for r in olds} | ({"p": 1} if sum(got) == 256 else {}))
        assert got == chunks


def _decoding(kv: KVCacheManager, *reqs: Request, reserve_kv: bool = True) -> Scheduler:
    """A colocated scheduler that decodes ahead, its requests past their prompts (one token sampled each)."""
    s = Scheduler(SchedulerConfig(decode_ahead=True, reserve_kv=reserve_kv), kv, 256)
    for r in reqs:
        s.add(r)
    out = s.schedule()
    s.update(out, sampled_for(out, 5))
    return s


def test_a_greedy_decode_in_flight_runs_ahead_with_the_workers_own_token():
    from kvflow.sched.output import AHEAD

    kv = KVCacheManager(64, 4)
    a, b = req("a", 3, max_tokens=6), req("b", 6, max_tokens=6)
    b.params = SamplingParams(max_tokens=6, temperature=0.8, seed=1, ignore_eos=True)  # sampled: never ahead
    s = _decoding(kv, a, b)
    n = s.schedule()
    ahead = s.schedule()  # only a, at the position after the one in flight, its token not known yet
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.ahead) for x in ahead.seqs] == [("a", 4, 1, True)]
    assert ahead.token_ids == [AHEAD] and len(a.block_ids) == 2  # (position 4 needs a's second block: taken)
    assert ahead.seqs[0].new_block_ids == (a.block_ids[1],) and s.schedule().is_empty  # one decode-ahead at most
    s.update(n, sampled_for(n, 6))
    assert a.output_token_ids == [5, 6] and "a" in s.in_flight and not s.ahead
    again = s.schedule()  # a decodes ahead of its decode-ahead batch; b is back
    assert sorted((x.request.request_id, x.start, x.ahead) for x in again.seqs) == [("a", 5, True), ("b", 7, False)]
    assert [x.completes_prompt for x in ahead.seqs] == [True]
    s.update(ahead, sampled_for(ahead, 7))
    assert a.output_token_ids == [5, 6, 7] and a.num_computed_tokens == 5


def test_a_request_finished_in_flight_keeps_its_blocks_until_its_decode_ahead_returns():
    kv = KVCacheManager(64, 4)
    a, b = req("a", 4, max_tokens=8), req("b", 4, max_tokens=8)
    a.eos_token_ids = (9,)
    b.eos_token_ids = (9,)
    b.params = SamplingParams(max_tokens=8, temperature=0)  # (not ignore_eos: its eos stops it)
    a.params = SamplingParams(max_tokens=8, temperature=0)
    s = _decoding(kv, a, b)
    n, ahead = s.schedule(), s.schedule()
    assert len(ahead.seqs) == 2
    s.abort(a)  # the client went away: both of a's batches still write into its blocks
    assert s.update(n, {"a": 6, "b": 9}) == [a, b]  # b stops (eos) in n: its token decoded ahead is void
    assert a.is_finished and b.finish_reason == "stop" and b.output_token_ids == [5, 9]
    assert kv.num_free_blocks == 64 - 4 and s.schedule().is_empty  # blocks held, nothing scheduled for them
    assert s.update(ahead, {"a": 1, "b": 1}) == [a, b] and kv.num_free_blocks == 64
    assert a.output_token_ids == [5] and b.output_token_ids == [5, 9] and not s.running and not s.in_flight


def test_no_decode_ahead_for_a_last_token_or_without_a_free_block():
    kv = KVCacheManager(2, 4)  # a holds both blocks once its 5th token runs, and its 6th fits them too
    a = req("a", 4, max_tokens=4)
    s = _decoding(kv, a)
    first = s.schedule()
    assert [x.request.request_id for x in first.seqs] == ["a"]  # position 4, in a's second block
    assert [(x.start, x.ahead) for x in s.schedule().seqs] == [(5, True)]  # position 5: same block
    kv2 = KVCacheManager(64, 4)
    last = req("z", 4, max_tokens=2)  # its token in flight is its last: nothing to decode ahead for
    s2 = _decoding(kv2, last)
    assert s2.schedule().seqs and s2.schedule().is_empty
    full = req("f", 7, max_tokens=8)  # position 8 needs a third block of a pool of two
    s3 = _decoding(KVCacheManager(2, 4), full, reserve_kv=False)
    assert [x.start for x in s3.schedule().seqs] == [7] and s3.schedule().is_empty


def test_rewind_drops_the_decode_ahead_and_frees_what_finished_in_flight():
    kv = KVCacheManager(64, 4)
    a, b = req("a", 4, max_tokens=3), req("b", 4, max_tokens=8)
    s = _decoding(kv, a, b)
    n, ahead = s.schedule(), s.schedule()
    s.update(n, sampled_for(n, 6))  # a: 2 of 3; its decode-ahead batch computes its 3rd
    n2 = s.schedule()  # a's last token (no decode-ahead past it) and b's decode-ahead
    assert {(x.request.request_id, x.ahead) for x in n2.seqs} == {("b", True)}
    s.update(ahead, sampled_for(ahead, 7))
    assert a.finish_reason == "length" and kv.num_free_blocks == 64 - 2  # a's blocks: its last batch is back
    gone = s.rewind({"b": 5})  # the stage died with n2 in flight: b redoes it without sampling twice
    assert gone == [] and not s.ahead and not s.in_flight and b.num_computed_tokens == 5
    redo = s.schedule()
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.full_table) for x in redo.seqs] == [("b", 5, 2, True)]


def test_what_cannot_decode_ahead_waits_for_the_next_batch_rather_than_split_off():
    kv = KVCacheManager(64, 4)
    a, b, c = req("a", 4, max_tokens=8), req("b", 4, max_tokens=8), req("c", 4, max_tokens=8)
    a.params = SamplingParams(max_tokens=8, temperature=0.8, seed=1, ignore_eos=True)  # sampled: never ahead
    s = _decoding(kv, a)
    n = s.schedule()
    s.add(b)
    assert s.schedule().is_empty  # nothing decodes ahead: b is not admitted into a batch of its own
    s.update(n, sampled_for(n))
    together = s.schedule()
    assert [(x.request.request_id, x.num_new_tokens) for x in together.seqs] == [("a", 1), ("b", 4)]
    s.update(together, sampled_for(together))
    n2 = s.schedule()  # a and b decode; then b (greedy) decodes ahead, and c is admitted beside it
    s.add(c)
    beside = s.schedule()
    assert [(x.request.request_id, x.ahead) for x in beside.seqs] == [("b", True), ("c", False)] and n2.seqs
