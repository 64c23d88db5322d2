"""A pipeline of one stage decoding ahead on the device (`kvflow.worker.compute`): a worker holding
every layer launches a step behind the one it launched before, that step's argmax fed in on the device
(`DecodeGraphs.launch`, `LastSampled.sources`), and only then reads the one before back and sends its
result. On the CPU the decode buffers run eagerly (KVFLOW_TEST_DECODE_BUFFERS=1 in worker processes),
through the same code as the captured graphs on CUDA."""

from __future__ import annotations

import time

import pytest
import torch
import zmq
from conftest import tiny_cache, tiny_config, tiny_model

from kvflow.model.cuda_graphs import DecodeGraphs
from kvflow.sched.output import AHEAD
from kvflow.wire import SeqStep, Step, StepResult, decode
from kvflow.worker.compute import StageCompute
from kvflow.worker.steps import LastSampled

SECRET = b"k" * 32
PROMPTS = {"a": [5, 17, 3, 40, 8], "b": [8, 1, 2], "c": [30, 31, 32, 33, 34, 35, 36]}
TABLES = {"a": [3, 7, 1], "b": [0, 9], "c": [4, 2, 6, 5]}  # block size 4: room for the prompt + 6 tokens


class Stage(StageCompute):
    """The state `StageCompute` reads of a `Worker`: one stage holding every layer, its results
    sent on a real socket (read back by `results`)."""

    def __init__(self, model, cache, graphs, ctx: zmq.Context, addr: str) -> None:
        self.model, self.cache, self.compute_cache, self.graphs = model, cache, cache, graphs
        self.device, self.name, self.secret = cache.device, "stage", SECRET
        self.tables, self.last = {}, LastSampled()
        self.sender = self.replicator = self.swapper = self.tiers = self.hidden_in = self.hidden_out = self.ids_out = None
        self.busy_s, self.steps, self.launched_ahead = 0.0, 0, 0
        self.engine_cfg = type("E", (), {"torch_dtype": torch.float32})
        self.out = ctx.socket(zmq.PUSH)
        self.out.connect(addr)
        self.errors = []

    def _to_controller(self, msg, tensor=None) -> None:
        self.errors.append(msg)

    def run(self, msg: Step) -> None:
        self._step(msg, None, self._prepare(msg))


def _results(sock: zmq.Socket) -> list[StepResult]:
    out = []
    while sock.poll(0):
        msg, _ = decode(sock.recv_multipart(), SECRET)
        out.append(msg)
    return out


def _prompt_step(batch: int, rids) -> Step:
    seqs = [SeqStep(r, 0, len(PROMPTS[r]), TABLES[r], True) for r in rids]
    return Step(0, batch, seqs, [t for r in rids for t in PROMPTS[r]], argmax_rows=list(range(len(seqs))))


def _decode_step(batch: int, ctx: dict[str, int], rids, free=()) -> Step:
    """Each request's next token as `AHEAD` (the id sampled for the position before), at context ctx[r] + 1."""
    seqs = [SeqStep(r, ctx[r], 1, []) for r in rids]
    for r in rids:
        ctx[r] += 1
    return Step(0, batch, seqs, [AHEAD] * len(seqs), list(free), argmax_rows=list(range(len(seqs))))


def _drive(ahead: bool, schedule) -> tuple[dict[str, list[int]], Stage]:
    """Run `schedule` (a list of steps, each given once the one before was handed over, as a controller
    decoding ahead sends them) through one stage; each request's tokens in order."""
    torch.manual_seed(0)
    cfg = tiny_config()
    model, cache = tiny_model(cfg), tiny_cache(cfg, num_blocks=16, block_size=4)
    graphs = DecodeGraphs(model, cache, max_batch=4, max_model_len=40, buckets=(1, 2, 4), capture=False, ahead=True)
    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    addr = f"inproc://results-{ahead}"
    sink.bind(addr)
    stage = Stage(model, cache, graphs if ahead else None, ctx, addr)
    tokens: dict[str, list[int]] = {}
    try:
        for msg in schedule():
            stage.run(msg)
            for res in _results(sink):
                for row, t in zip(res.argmax_rows, res.argmax_ids):
                    tokens.setdefault(res.rids[row], []).append(t)
        if stage.last.flight is not None:
            stage._land()
        for res in _results(sink):
            for row, t in zip(res.argmax_rows, res.argmax_ids):
                tokens.setdefault(res.rids[row], []).append(t)
    finally:
        stage.out.close(0)
        sink.close(0)
        ctx.term()
    assert not stage.errors
    return tokens, stage


def _schedule():
    """Prompts of a, b, c (a and b in one step); then decode steps ahead, c joining late, b freed
    after its fourth token while a step holding it is still in flight."""
    ctx = {r: len(p) for r, p in PROMPTS.items()}
    yield _prompt_step(0, ["a", "b"])
    yield _decode_step(1, ctx, ["a", "b"])
    yield _decode_step(2, ctx, ["a", "b"])
    yield _prompt_step(3, ["c"])
    yield _decode_step(4, ctx, ["a", "b", "c"])
    yield _decode_step(5, ctx, ["a", "c"], free=["b"])
    yield _decode_step(6, ctx, ["a", "c"])
    yield _decode_step(7, ctx, ["c"])


def test_steps_launched_behind_the_one_before_give_the_serial_stages_tokens():
    serial, _ = _drive(False, _schedule)
    ahead, stage = _drive(True, _schedule)
    assert ahead == serial
    assert [len(serial[r]) for r in "abc"] == [6, 4, 5]
    # steps 2, 5 (behind 1 and 4: their AHEADs on the device) and 6, 7; 1 and 4 follow a prompt step,
    # which runs one at a time and reads its ids back before the next
    assert stage.launched_ahead == 4
    assert "b" not in stage.last.ids  # read back after a later step freed it: not kept


def test_landed_rings_each_launch_once_its_ids_are_in_and_names_it():
    """The worker's loop polls `Landed.sock` beside its step socket while a step is in flight; each ring
    names its launch, so a ring for a flight read back sooner is told apart from the current one's."""
    from kvflow.model.cuda_graphs import Launch
    from kvflow.worker.compute import Landed

    ctx = zmq.Context()
    landed = Landed(ctx)
    try:
        ids = torch.arange(4)
        tickets = [landed.watch(Launch(ids, None, 4)) for _ in range(3)]
        assert tickets == [1, 2, 3]
        rung, deadline = 0, time.monotonic() + 10
        while rung < 3 and time.monotonic() < deadline and landed.sock.poll(1000):
            rung = max(rung, landed.rung())
        assert rung == 3 and landed.rung() == 0  # (drained: nothing rings twice)
    finally:
        landed.close()
        ctx.term()


def test_an_ahead_row_with_no_source_is_refused():
    """A step whose `AHEAD` names a position neither in flight nor read back is a bug upstream: it
    fails the step (reported), never runs on a stale id."""
    def schedule():
        ctx = {r: len(p) for r, p in PROMPTS.items()}
        yield _prompt_step(0, ["a"])
        ctx["a"] += 1  # skips a position
        yield _decode_step(1, ctx, ["a"])

    with pytest.raises(RuntimeError, match="no token sampled"):
        _drive(True, schedule)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])])
@pytest.mark.parametrize("kw", [dict(mode="colocated", depth=1), dict(mode="disaggregated", prompt_depth=1, token_depth=1)],
                         ids=["colocated-1", "disagg-1-1"])
def test_one_stage_pipelines_decoding_ahead_on_the_device_give_the_engines_tokens(tiny_ckpt_dir, kw, device, monkeypatch):
    """Worker processes whose one stage holds every layer: their graphs are built to decode ahead and
    greedy decode steps are launched on the device, behind the one before when it comes in time
    (counted in the stage's heartbeats: the controller sends a step's successor before its result).
    On CUDA the graphs are captured; the tokens are the CPU engine's (float32)."""
    from dataclasses import replace

    from test_controller import LENGTHS, PROMPTS as CPROMPTS, _cfg, next_heartbeat, reference, serve

    lengths = [3 * n for n in LENGTHS]
    expected = reference(CPROMPTS, lengths)
    monkeypatch.setenv("KVFLOW_TEST_DECODE_BUFFERS", "1")  # (the CPU's eager graph buffers; on CUDA, captured ones)
    cfg = _cfg(tiny_ckpt_dir, **kw)
    cfg = replace(cfg, engine=replace(cfg.engine, device=device))
    launched = []

    async def after(ctrl):
        stage = ctrl.pipelines[-1].stages[0]  # (the token pipeline's, or the colocated one's)
        await next_heartbeat(stage)
        launched.append(stage.launched_ahead)

    results, _, free = serve(cfg, CPROMPTS, lengths, after=after)
    assert [toks for toks, _ in results] == expected
    assert launched[0] > 0
    assert free == [128] * len(free)
