"""`kvflow profile`: time the real single-process engine's prefill and decode steps on this machine.

Each prefill sample admits `b` requests of `s` random prompt tokens at once and times the one
engine step that prefills them all (sampling included, as in serving). Decode samples time the
following steps of `b` requests, one per context length reached. torch is imported here only,
so `kvflow.perf` stays importable without it.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.perf.model_shape import ModelShape
from kvflow.perf.profiled import Profile, Sample


def _engine(model: str | None, max_batch: int, max_tokens: int, threads: int):
    from kvflow.config import EngineConfig
    from kvflow.engine.engine import LLMEngine
    from kvflow.sched.scheduler import SchedulerConfig

    sched = SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=max_tokens, prefill_chunk_size=max_tokens)
    return LLMEngine.from_config(EngineConfig(model=model, scheduler=sched, num_threads=threads,
                                              kv_cache_memory_gb=2.0))


def shape_of(engine) -> ModelShape:
    c = engine.model.cfg
    dtype_bytes = engine.kv_cache.layout.dtype_bytes
    return ModelShape(c.name, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                      c.intermediate_size, c.vocab_size, dtype_bytes=dtype_bytes, gated_mlp=True)


def _prompts(rng, b: int, s: int, vocab: int) -> list[list[int]]:
    return [[int(x) for x in rng.integers(10, vocab - 10, s)] for _ in range(b)]


def time_prefill(engine, b: int, s: int, repeats: int, rng, warm_up: bool = True) -> float:
    """Median seconds of one step that prefills `b` prompts of `s` tokens (`repeats` runs, after an
    untimed one when `warm_up`)."""
    from kvflow.sched.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    times = []
    for _ in range(repeats + warm_up):
        for p in _prompts(rng, b, s, engine.model.cfg.vocab_size):
            engine.add_request(p, params)
        times.append(timed_step(engine))
        while engine.has_unfinished():
            engine.step()
    return statistics.median(times[warm_up:])


class ForwardTimer:
    """Times the model's forward inside the engine's steps (installed on the engine's model), so
    a step's host-side work (scheduling, sampling, outputs) can be told from the forward a worker
    process runs; `host_s` holds step - forward of each timed step."""

    def __init__(self, engine) -> None:
        self._forward = engine.model.forward
        self.last = 0.0
        self.host_s: list[float] = []
        engine.model.forward = self._timed

    def _timed(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return self._forward(*a, **kw)
        finally:
            self.last = time.perf_counter() - t0

    def step(self, engine) -> float:
        """One engine step; returns its seconds and records its host-side share."""
        self.last = 0.0
        dt = timed_step(engine)
        self.host_s.append(dt - self.last)
        return dt


def timed_step(engine) -> float:
    """Seconds of one engine step."""
    t0 = time.perf_counter()
    engine.step()
    return time.perf_counter() - t0


def time_decode(engine, b: int, c: int, steps: int, rng, timer: ForwardTimer | None = None) -> list[Sample]:
    """Seconds of each of `steps` decode steps of `b` requests whose prompts have `c` tokens."""
    from kvflow.sched.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.0)
    for p in _prompts(rng, b, c, engine.model.cfg.vocab_size):
        engine.add_request(p, params)
    engine.step()  # prefill
    engine.step()  # first decode (warm-up)
    out = []
    for k in range(steps):
        out.append(Sample(b, c + 2 + k, timer.step(engine) if timer is not None else timed_step(engine)))
    while engine.has_unfinished():
        engine.step()
    return out


def profile_engine(model: str | None, batches: tuple[int, ...], prompt_lens: tuple[int, ...],
                   contexts: tuple[int, ...], repeats: int = 3, threads: int = 1, decode_steps: int = 2) -> Profile:
    """Time the grid in `repeats` passes, each visiting every shape once in a shuffled order: a
    prefill sample is the median of its shape's passes; each pass adds `decode_steps` decode
    samples per (batch, context). On a machine whose speed moves over seconds (a shared VM),
    back-to-back repeats let one slow spell price one shape, and the fit's slopes follow it;
    spread over the whole window, a slow spell touches every shape a little (the prompt fit's worst
    error on its own grid fell by a multiple: docs/results.md, 2026-11-25 fidelity). What shuffling
    cannot remove is the machine's speed moving as a whole between windows of tens of seconds
    (every shape slower in one calibration than in the one before); `benchmarks/fidelity.py`
    averages many windows for that."""
    import numpy as np
    import torch

    if min(batches) < 1 or min(prompt_lens) < 1 or min(contexts) < 1 or repeats < 1 or decode_steps < 1:
        raise ValueError("batches, lengths, repeats and decode steps must be >= 1")
    engine = _engine(model, max(batches), max(batches) * max(max(prompt_lens), max(contexts)), threads)
    rng = np.random.default_rng(0)
    time_prefill(engine, max(batches), max(prompt_lens), 1, rng, warm_up=False)  # warm-up (untimed): the largest prefill
    timer = ForwardTimer(engine)
    prefill: dict[tuple[int, int], list[float]] = {}
    token: list[Sample] = []
    shapes = [("prefill", b, s) for b in batches for s in prompt_lens] + [("decode", b, c) for b in batches for c in contexts]
    for _ in range(repeats):
        for i in rng.permutation(len(shapes)):
            kind, b, n = shapes[i]
            if kind == "prefill":
                prefill.setdefault((b, n), []).append(time_prefill(engine, b, n, 1, rng, warm_up=False))
            else:
                token.extend(time_decode(engine, b, n, decode_steps, rng, timer))
    prompt = tuple(Sample(b, s, statistics.median(prefill[(b, s)])) for b in batches for s in prompt_lens)
    meta = {"threads": threads, "torch": torch.__version__, "platform": platform.platform(),
            "processor": platform.processor(), "model": model or "embedded SmolLM2-135M", "repeats": repeats,
            "decode_steps": decode_steps}
    return Profile(shape_of(engine), "1xCPU", prompt, tuple(token), meta, engine_host_s=statistics.median(timer.host_s))


@dataclass(frozen=True)
class ExecutorOverhead:
    """What worker processes add to a pass's compute (`calibrate.executor_overhead`): per pass,
    `pass_s + seq_s * sequences` (the controller's round trip: its codec, sampling and outputs, and
    the first stage's messages), plus `hop_s` for each further stage, plus `prompt_s` for a pass
    that prefills."""

    pass_s: float
    seq_s: float
    hop_s: float
    measured: dict  # "depth,batch" -> seconds: client gap minus the workers' compute
    prompt_s: float = 0.0  # what a prompt pass adds to that (one stage): time to first token minus its compute


def executor_overhead(model: str | None, batches: tuple[int, ...] = (1, 2, 4), depths: tuple[int, ...] = (1, 2),
                      prompt_len: int = 16, steps: int = 16, threads: int = 1) -> ExecutorOverhead:
    """What a pipeline of worker processes adds per pass to the step's compute (messages and their
    codec, the controller's round trip and sampling): through a colocated `Controller` of each depth
    in `depths`, decode steps of each of `batches` requests: the median gap between tokens at the
    client minus the median compute time the workers themselves report for those steps (`busy_s` of
    each step result: every stage's compute, summed). A line in the batch size through the one-stage
    measurements gives the pass's cost and its cost per sequence; the median extra of a two-stage
    pass over a one-stage one at the same batch is the cost of one more stage. A prompt pass costs
    more than a decode pass of as many sequences (measured on one stage: docs/results.md,
    2026-11-25 fidelity, "a prompt pass's own overhead"): its
    extra, the first request's time to first token minus the compute of the round's first step
    (its prefill) minus the decode line's price for that step's sequences, median over the
    one-stage rounds, is `prompt_s`.

    Both terms of a measurement come from the same steps of the same run, so the step time's own
    run-to-run noise cancels. The cost grows with the batch, and a second stage adds a fraction of
    a round trip, so the earlier single number (the median over batches 1 and 4, charged to every
    stage) priced a depth-2 pipeline's decode step too slow in the fidelity replay, where the
    median step decodes one sequence (docs/results.md, 2026-11-25 fidelity)."""
    import asyncio

    import numpy as np

    from kvflow.config import ClusterConfig, EngineConfig
    from kvflow.controller.controller import Controller
    from kvflow.sched.sampling import SamplingParams
    from kvflow.sched.scheduler import SchedulerConfig

    if not batches or min(batches) < 1 or 1 not in depths or min(depths) < 1:
        raise ValueError("batches >= 1, and depths must include 1")
    rng = np.random.default_rng(1)
    sched = SchedulerConfig(max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * prompt_len,
                            prefill_chunk_size=prompt_len)

    async def run(depth: int) -> tuple[dict[int, float], list[tuple[int, float]]]:
        cfg = ClusterConfig(engine=EngineConfig(model=model, num_kv_blocks=256, num_threads=threads, scheduler=sched),
                            mode="colocated", depth=depth, microbatch_size=max(batches), threads_per_worker=threads)
        ctrl = Controller(cfg)
        await ctrl.start()
        over: dict[int, float] = {}
        first: list[tuple[int, float]] = []  # (sequences of the round's prefill step, TTFT minus its compute)
        try:
            log = ctrl.pipelines[0].step_log
            for k, b in enumerate((batches[0],) + tuple(batches)):  # the first round warms up
                stamps: list[float] = []
                params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
                before = len(log)
                submitted = time.perf_counter()

                async def one(i: int) -> None:
                    prompt = [int(x) for x in rng.integers(10, ctrl.vocab_size - 10, prompt_len)]
                    async for out in ctrl.generate(prompt, params, f"calib-{depth}-{k}-{i}"):
                        if i == 0:
                            stamps.extend([time.perf_counter()] * len(out.new_token_ids))

                await asyncio.gather(*[one(i) for i in range(b)])
                # the decode steps of this round (one new token per sequence), after the first one
                busy = [r.busy_s for r in list(log)[before:] if r.tokens == b][1:]
                gap = float(np.median(np.diff(stamps)[1:]))
                if k:
                    over[b] = gap - float(np.median(busy))
                    n, prefill_busy, _ = list(log)[before]  # the round's first step: request 0's prefill
                    first.append((max(1, n // prompt_len), stamps[0] - submitted - prefill_busy))
        finally:
            await ctrl.shutdown()
        return over, first

    runs = {d: asyncio.run(run(d)) for d in depths}
    measured = {d: r[0] for d, r in runs.items()}
    one = measured[1]
    deeper = [(measured[d][b] - one[b]) / (d - 1) for d in depths if d > 1 for b in batches]
    hop = max(0.0, statistics.median(deeper)) if deeper else 0.0
    xs = np.array(sorted(one), dtype=float)
    ys = np.array([one[int(b)] for b in xs])
    seq = max(0.0, float(np.polyfit(xs, ys, 1)[0])) if len(xs) > 1 else 0.0
    base = max(0.0, float(np.median(ys - seq * xs)))
    prompt = max(0.0, float(np.median([gap - base - seq * n for n, gap in runs[1][1]])))
    return ExecutorOverhead(base, seq, hop, {f"{d},{b}": v for d in depths for b, v in measured[d].items()}, prompt)


def co_runner(model: str | None, threads: int = 1) -> None:
    """A busy neighbour (run in its own process by `co_run_slowdown`): an engine that keeps four
    requests in flight (64-token prompts, 24 tokens each), as a worker of the same host would;
    prints "ready" once loaded and runs until killed."""
    import numpy as np

    from kvflow.sched.sampling import SamplingParams

    engine = _engine(model, 4, 256, threads)
    rng = np.random.default_rng(2)
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    print("ready", flush=True)
    while True:
        while len(engine.requests) < 4:
            engine.add_request(_prompts(rng, 1, 64, engine.model.cfg.vocab_size)[0], params)
        engine.step()


def co_run_slowdown(model: str | None, threads: int = 1, rounds: int = 6) -> tuple[float, float]:
    """How much slower the engine's steps run while another worker process on the same host is
    busy (`co_runner`): (prefill, decode) ratios of the median step times with and without the
    neighbour (one process, paused and resumed), the two conditions alternated `rounds` times.
    Shapes: prefill of 2 x 80 tokens, decode of 3 sequences at context ~160 (off the calibration
    grid and the replays).
    The simulator applies them to a stage's step while another stage of the same host computes
    (`SimConfig.shared_host`): on a machine whose cores and memory bandwidth the workers share,
    a step alone is not a step beside a busy neighbour."""
    import signal
    import subprocess
    import sys

    import numpy as np

    engine = _engine(model, 4, 512, threads)
    rng = np.random.default_rng(3)
    code = f"from kvflow.perf.calibrate import co_runner; co_runner({model!r}, {threads})"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    times: dict[tuple[str, bool], list[float]] = {}
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the co-running engine did not start")
        time_prefill(engine, 2, 80, 1, rng)  # warm-up
        for _ in range(rounds):
            for busy in (False, True):  # the neighbour is paused (SIGSTOP) or running (SIGCONT)
                proc.send_signal(signal.SIGCONT if busy else signal.SIGSTOP)
                time.sleep(0.2)
                times.setdefault(("prefill", busy), []).append(time_prefill(engine, 2, 80, 2, rng))
                times.setdefault(("decode", busy), []).extend(s.seconds for s in time_decode(engine, 3, 160, 6, rng))
    finally:
        proc.kill()
        proc.wait()
    med = {k: statistics.median(v) for k, v in times.items()}
    return med[("prefill", True)] / med[("prefill", False)], med[("decode", True)] / med[("decode", False)]


# The calibration grid of the benchmarks that compare the simulator with real runs
# (`benchmarks/fidelity.py`, `benchmarks/fault_tolerance.py`): whole prompts and decode contexts on
# their own shapes, never the replayed requests'. Prompt lengths are dense at the short end: a short
# prefill's cost is far from a line through long ones, and a line through a grid of 16 / 48 / 112
# alone took its intercept from one noisy short point (docs/results.md, 2026-11-23 fidelity).
GRID_BATCHES, GRID_PROMPTS, GRID_CONTEXTS = (1, 2, 4), (8, 16, 24, 32, 48, 80, 112), (24, 96, 224)


def calibrate_engine(model: str | None = None, passes: int = 3) -> Profile:
    """The engine on the grid above (one torch thread) in `passes` shuffled passes, plus loading the
    model: short enough to run right before every replay of a fidelity run."""
    return profile_engine(model, GRID_BATCHES, GRID_PROMPTS, GRID_CONTEXTS, repeats=passes, threads=1)


def calibrate(model: str | None = None, passes: int = 3) -> Profile:
    """One calibration on this machine: the engine on the grid above (`calibrate_engine`), the
    overhead of worker pipelines (`executor_overhead`) and the slowdown beside a busy neighbour
    (`co_run_slowdown`); the slowest part of a fidelity run."""
    from dataclasses import replace

    t0 = time.perf_counter()
    prof = calibrate_engine(model, passes)
    over = executor_overhead(model)
    print("worker pipelines, client gap minus the workers' compute (depth,batch: ms): "
          + ", ".join(f"{k}: {v * 1e3:.1f}" for k, v in over.measured.items())
          + f" -> {over.pass_s * 1e3:.1f} ms a pass + {over.seq_s * 1e3:.2f} a sequence, {over.hop_s * 1e3:.1f} a further stage,"
          f" {over.prompt_s * 1e3:.1f} more for a prompt pass", flush=True)
    prof = replace(prof, pass_overhead_s=over.pass_s, seq_overhead_s=over.seq_s, hop_overhead_s=over.hop_s,
                   prompt_overhead_s=over.prompt_s, co_run=co_run_slowdown(model))
    print(f"calibrated in {time.perf_counter() - t0:.0f} s", flush=True)
    return prof


def merge_profiles(profiles: Sequence[Profile], more_samples: Sequence[Profile] = ()) -> Profile:
    """Calibrations of one model on one machine taken at different times, as one profile: the
    samples of all of them (the fits are drawn through every one), and the median of each measured
    overhead and slowdown term. `more_samples`: engine-only profiles (`calibrate_engine`: no worker
    terms measured) whose samples join the fits."""
    from dataclasses import replace

    if not profiles:
        raise ValueError("no profiles to merge")
    first = profiles[0]
    if any(p.shape != first.shape or p.machine != first.machine for p in (*profiles, *more_samples)):
        raise ValueError("profiles of different models or machines")
    def med(term) -> float:
        return statistics.median(term(p) for p in profiles)

    every = (*profiles, *more_samples)
    return replace(first, prompt=tuple(s for p in every for s in p.prompt), token=tuple(s for p in every for s in p.token),
                   meta={**first.meta, "calibrations": len(profiles), "engine_windows": len(every)},
                   pass_overhead_s=med(lambda p: p.pass_overhead_s), seq_overhead_s=med(lambda p: p.seq_overhead_s),
                   hop_overhead_s=med(lambda p: p.hop_overhead_s), prompt_overhead_s=med(lambda p: p.prompt_overhead_s),
                   engine_host_s=statistics.median(p.engine_host_s for p in every),
                   co_run=(med(lambda p: p.co_run[0]), med(lambda p: p.co_run[1])))


def calibrated_profile(path, model: str | None = None, reprofile: bool = False) -> Profile:
    """The profile saved at `path`; when missing (or `reprofile`), `calibrate` afresh and save it there."""
    from pathlib import Path

    path = Path(path)
    if reprofile or not path.exists():
        print(f"profiling the engine and worker pipelines of one and two stages -> {path} ...", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        calibrate(model).save(path)
    return Profile.load(path)
