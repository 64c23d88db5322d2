"""The single-process engine decoding ahead (`EngineConfig.decode_ahead`): a step launches the next
greedy decode step, its input ids taken from the device buffer the step in flight's argmax lands in,
before it reads those ids back. On the CPU the decode buffers run eagerly (`DecodeGraphs(capture=False)`,
as KVFLOW_TEST_DECODE_BUFFERS=1 makes the engine build them), through the same code as on CUDA: the
tokens, finishes, aborts and freed blocks must be the serial engine's."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_cache, tiny_config, tiny_model

from kvflow.config import EngineConfig
from kvflow.engine.engine import LLMEngine
from kvflow.model.batch import ForwardBatch
from kvflow.model.cuda_graphs import DecodeGraphs
from kvflow.sched.config import SchedulerConfig
from kvflow.sched.sampling import SamplingParams

BLOCKS = 96


def engine(ahead: bool, monkeypatch, max_num_seqs: int = 8, **sched) -> LLMEngine:
    """A tiny float32 engine (batch-invariant, so a token does not depend on the batch around it) whose
    decode steps go through the decode buffers; `ahead`: decoding ahead, else one step at a time."""
    monkeypatch.setenv("KVFLOW_TEST_DECODE_BUFFERS", "1")
    cfg = EngineConfig(block_size=4, num_kv_blocks=BLOCKS, deterministic=True, decode_ahead=ahead,
                       scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, **sched))
    model = tiny_model(tiny_config())
    eng = LLMEngine(model, None, cfg)
    assert eng.runner.graphs is not None and eng.decode_ahead == ahead
    return eng


def prompt(i: int) -> list[int]:
    return [(7 * i + 3 * k) % 88 + 5 for k in range(3 + (5 * i) % 13)]


def drive(eng: LLMEngine, work: dict[int, list], aborts: dict[int, list[str]] | None = None) -> dict:
    """Step `eng` to the end, adding `work[step]` [(prompt, params, id)] before step `step` and aborting
    `aborts[step]` before it; every output of every request in order: id -> [(new ids, finished, reason)]."""
    seen: dict[str, list] = {}
    step = 0
    while eng.has_unfinished() or any(k >= step for k in work):
        for p, params, rid in work.get(step, []):
            eng.add_request(p, params, rid)
        for rid in (aborts or {}).get(step, []):
            eng.abort_request(rid)
        for out in eng.step():
            seen.setdefault(out.request_id, []).append((tuple(out.new_token_ids), out.finished, out.finish_reason))
        step += 1
        assert step < 2_000, "the engine did not finish"
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks and not eng.requests  # nothing held or left
    return seen


def tokens(seen: dict) -> dict[str, list[int]]:
    out = {}
    for rid, outs in seen.items():
        assert [f for _, f, _ in outs].count(True) == 1 and outs[-1][1], f"{rid}: exactly one final output, the last"
        out[rid] = [t for new, _, _ in outs for t in new]
    return out


def test_greedy_tokens_of_many_requests_are_the_serial_engines(monkeypatch):
    params = [SamplingParams(max_tokens=3 + (4 * i) % 17, temperature=0, ignore_eos=True) for i in range(14)]
    work = {0: [(prompt(i), params[i], f"r{i}") for i in range(14)]}
    serial = drive(engine(False, monkeypatch), work)
    eng = engine(True, monkeypatch)
    ahead = drive(eng, work)
    assert tokens(ahead) == tokens(serial)
    assert {r: len(t) for r, t in tokens(ahead).items()} == {f"r{i}": p.max_tokens for i, p in enumerate(params)}
    assert eng.scheduler.ahead_seqs > 20 and eng.runner.launches > 20  # it did decode ahead


def test_requests_that_stop_mid_flight_finish_as_in_the_serial_engine(monkeypatch):
    """Stop ids and EOS met while the next step is already launched: the extra token is dropped."""
    base = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = tokens(drive(engine(False, monkeypatch), {0: [(prompt(i), base, f"r{i}") for i in range(6)]}))
    # each request stops at an id it produces at its 2nd..6th token (EOS, id 2, is not ignored either)
    params = [SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[first[f"r{i}"][1 + i]]) for i in range(5)]
    params.append(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, min_tokens=4))
    work = {0: [(prompt(i), params[i], f"r{i}") for i in range(6)]}
    serial, eng = drive(engine(False, monkeypatch), work), engine(True, monkeypatch)
    ahead = drive(eng, work)
    assert tokens(ahead) == tokens(serial)
    assert [ahead[f"r{i}"][-1][2] for i in range(6)] == ["stop"] * 5 + ["length"]
    assert all(len(tokens(ahead)[f"r{i}"]) < 12 for i in range(5)) and eng.runner.launches > 5


def test_aborts_while_a_batch_is_in_flight(monkeypatch):
    """Requests aborted while their next step is on the device: told nothing more, their blocks freed
    when it comes back (`drive` checks the pool), the others' tokens unchanged."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    work = {0: [(prompt(i), params, f"r{i}") for i in range(5)]}
    serial = tokens(drive(engine(False, monkeypatch), work))
    eng = engine(True, monkeypatch)
    in_flight_at_abort = []
    orig_abort = eng.abort_request

    def abort(rid: str) -> None:
        in_flight_at_abort.append(eng._in_flight is not None and rid in eng._in_flight.rows)
        orig_abort(rid)

    eng.abort_request = abort
    seen = drive(eng, work, aborts={6: ["r1"], 9: ["r3", "r4"]})
    assert in_flight_at_abort == [True, True, True]
    assert "r1" in seen and not any(f for _, f, _ in seen["r1"])  # tokens before the abort, no final output
    got = {r: [t for new, _, _ in outs for t in new] for r, outs in seen.items()}
    for rid in ("r0", "r2"):
        assert got[rid] == serial[rid]
    for rid in ("r1", "r3", "r4"):
        assert 0 < len(got[rid]) < 20 and got[rid] == serial[rid][:len(got[rid])]


def test_mixed_greedy_and_seeded_sampling_give_the_serial_tokens(monkeypatch):
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    work = {0: [(prompt(i), greedy if i % 3 else sampled, f"r{i}") for i in range(6)]}
    serial, eng = tokens(drive(engine(False, monkeypatch), work)), engine(True, monkeypatch)
    assert tokens(drive(eng, work)) == serial
    assert eng.runner.launches > 0  # once the sampled requests are done, the greedy ones go ahead


def test_requests_arriving_while_a_batch_is_in_flight(monkeypatch):
    """New prompts join while greedy decodes run ahead (their prompt chunk runs serially beside the
    decode-ahead rows, fed the ids just read back), with a small token budget so prompts are chunked."""
    params = [SamplingParams(max_tokens=4 + i % 5, temperature=0, ignore_eos=True) for i in range(10)]
    work = {s: [(prompt(i), params[i], f"r{i}") for i in range(10) if 2 * i + (i % 3) == s] for s in range(25)}
    work = {s: w for s, w in work.items() if w}
    serial, eng = drive(engine(False, monkeypatch, max_num_batched_tokens=10), work), engine(True, monkeypatch,
                                                                                             max_num_batched_tokens=10)
    assert tokens(drive(eng, work)) == tokens(serial)
    assert eng.runner.launches > 10


def test_a_batch_larger_than_the_graphs_runs_serially(monkeypatch):
    """More running requests than the graphs take (max_num_seqs 8 > their 4 rows here): no launch."""
    eng = engine(True, monkeypatch)
    eng.runner.graphs = DecodeGraphs(eng.model, eng.kv_cache, 4, eng.max_model_len, buckets=(4,), capture=False, ahead=True)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    work = {0: [(prompt(i), params, f"r{i}") for i in range(6)]}
    assert tokens(drive(eng, work)) == tokens(drive(engine(False, monkeypatch), work))
    assert eng.runner.launches == 0


def test_an_id_still_in_flight_is_refused_and_bad_flags_are_refused(monkeypatch):
    eng = engine(True, monkeypatch)
    eng.add_request(prompt(1), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), "a")
    eng.step()
    eng.step()
    eng.abort_request("a")  # its next step is still on the device
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request(prompt(2), None, "a")
    while eng.has_unfinished():
        assert eng.step() == []
    eng.add_request(prompt(2), SamplingParams(max_tokens=2), "a")  # free again
    with pytest.raises(ValueError, match="decode_ahead must be a bool"):
        EngineConfig(decode_ahead="yes")
    monkeypatch.delenv("KVFLOW_TEST_DECODE_BUFFERS")
    plain = LLMEngine(tiny_model(), None, EngineConfig(block_size=4, num_kv_blocks=16))
    assert plain.runner.graphs is None and not plain.decode_ahead  # the CPU default: no graphs, nothing ahead
    assert not plain.scheduler.config.decode_ahead


def test_a_step_fed_the_argmax_on_the_device_gives_the_step_fed_it_from_the_host():
    """`DecodeGraphs(ahead=True)`: rows whose source is a row of the step before take its argmax."""
    cfg = tiny_config()
    model = tiny_model(cfg)
    caches = [tiny_cache(cfg, 32, 4) for _ in range(2)]
    prompts, blocks = [[3, 9, 27, 5], [4, 11], [8, 8, 8]], [[7, 2], [9], [1, 3]]
    ids = torch.tensor([t for p in prompts for t in p])
    for c in caches:
        model.forward(ids, ForwardBatch.of([(len(p), len(p), b) for p, b in zip(prompts, blocks)], 4), c)
    ctx1 = [(len(p) + 1, b) for p, b in zip(prompts, blocks)]
    ctx2 = [(c + 1, b) for c, b in ctx1[:2]]
    ahead = DecodeGraphs(model, caches[0], 4, 32, capture=False, ahead=True)
    plain = DecodeGraphs(model, caches[1], 4, 32, capture=False)
    first = plain.run(ctx1, tokens=[40, 41, 42])
    assert torch.equal(ahead.run(ctx1, tokens=[40, 41, 42]), first)
    want_ids = first.argmax(-1)
    assert torch.equal(ahead.argmax_ids(3), want_ids)
    # step 2: row 0 takes row 2's id from the device, row 1 a host token; the placeholder token is ignored
    got = ahead.run(ctx2, tokens=[-1, 50], sources=[2, -1])
    want = plain.run(ctx2, tokens=[int(want_ids[2]), 50])
    assert torch.equal(got, want)
    assert torch.equal(caches[0].data, caches[1].data)  # the same KV written
    with pytest.raises(ValueError, match="source"):
        ahead.run(ctx2, tokens=[1, 2], sources=[2, 0])  # the step before had 2 rows
    with pytest.raises(ValueError, match="ahead=True"):
        plain.run(ctx2, tokens=[1, 2], sources=[0, 1])


def test_the_llm_class_generates_and_streams_the_serial_tokens(monkeypatch):
    from kvflow.engine.llm import LLM

    params = [SamplingParams(max_tokens=4 + i, temperature=0, ignore_eos=True) for i in range(5)]
    ids = [prompt(i) for i in range(5)]
    want = [o.token_ids for o in LLM.from_engine(engine(False, monkeypatch)).generate(ids, params, use_tqdm=False)]
    llm = LLM.from_engine(engine(True, monkeypatch))
    assert [o.token_ids for o in llm.generate(ids, params, use_tqdm=False)] == want
    streamed = [t for out in llm.stream(ids[2], params[2]) for t in out.new_token_ids]
    assert streamed == want[2] and llm.engine.runner.launches > 5
    for _ in llm.stream(ids[0], params[0]):  # left after its first output: aborted, maybe with a step in flight
        break
    assert llm.generate(ids[:2], params[:2], use_tqdm=False)[1].token_ids == want[1]
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_the_server_backend_streams_the_serial_tokens_and_survives_clients_leaving(tiny_ckpt_dir, monkeypatch):
    """`EngineBackend` (the server's engine thread) over an engine decoding ahead: concurrent streams
    give the serial engine's tokens, and streams cancelled mid-way (aborts while a step is in flight)
    leave the others whole and the pool free."""
    import asyncio

    from kvflow.serving.backend import EngineBackend

    monkeypatch.setenv("KVFLOW_TEST_DECODE_BUFFERS", "1")
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True) for i in range(6)]

    def build(ahead: bool) -> LLMEngine:
        eng = LLMEngine.from_config(EngineConfig(model=str(tiny_ckpt_dir), num_kv_blocks=256, block_size=4,
                                                 deterministic=True, decode_ahead=ahead))
        assert eng.decode_ahead == ahead
        return eng

    serial = build(False)
    want = {}
    for i in range(6):
        serial.add_request(prompt(i), params[i], f"r{i}")
    while serial.has_unfinished():
        for out in serial.step():
            if out.finished:
                want[out.request_id] = out.token_ids
    eng = build(True)
    backend = EngineBackend(eng, "tiny")

    async def one(i: int, leave_after: int | None) -> list[int]:
        got = []
        async for out in backend.generate(prompt(i), params[i], f"r{i}"):
            got += out.new_token_ids
            if leave_after is not None and len(got) >= leave_after:
                break
        return got

    async def main() -> list[list[int]]:
        await backend.start()
        try:
            return await asyncio.gather(*(one(i, 3 if i in (1, 4) else None) for i in range(6)))
        finally:
            for _ in range(200):  # the aborted requests' steps in flight come back
                if not eng.has_unfinished():
                    break
                await asyncio.sleep(0.01)
            await backend.shutdown()

    got = asyncio.run(main())
    for i in range(6):
        if i in (1, 4):
            assert got[i] == want[f"r{i}"][:len(got[i])] and len(got[i]) >= 3
        else:
            assert got[i] == want[f"r{i}"]
    assert eng.runner.launches > 5 and eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks and not eng.requests
