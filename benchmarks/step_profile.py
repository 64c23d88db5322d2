"""Where an engine step's time goes on this CPU: projections by path, attention, the fused elementwise
passes, the rest of the model, sampling and host work (scheduling, batch building, updates).

    python benchmarks/step_profile.py [--dtype bfloat16] [--threads 2] [--batches 16 32 64] [--steps 8]

The embedded SmolLM2-135M in one `LLMEngine`, prefix caching off, token budget `OFFLINE_TOKEN_BUDGET`.
Workloads: a decode step at each of --batches (that many requests with --prompt-len-token random
prompts, timed once every prompt is in, at --temperature: the vLLM client's default 1.0 samples the
whole vocabulary), and a prefill step of one --prefill-len-token prompt. Three engines, interleaved
per repeat: "fast" (`deterministic` off, the default: each row count's projection path measured at
load among every `SMALL_PATHS`, the decode attention kernel), "fast, no fixed" (the same without the
"fixed" path, `KVFLOW_LINEAR_PATHS`: the rule before it was a candidate) and "deterministic"
(`invariant_linear` for every projection, decode rows through the prefill attention kernel).

How: the callables a step goes through are wrapped in wall-clock timers for the measured steps only
(`Linear.__call__`, the attention and elementwise kernels of `cpu_kernels`, `LlamaModel.forward`, the
runner's `sample_requests`, `LLMEngine.step`); the CPU kernels are synchronous, so a call's wall time
is its cost. A decode step normally runs its layers in one native call (`cpu_kernels.decode_layers`,
bitwise the per-op path, without the Python between ops), which no timer can look into: the
breakdown is of the per-op path (`native_decode` off), and the decode steps alternate between it
and the untimed native step ("untimed step, native decode"), so the per-op path's overhead is
visible. "model other" is the model's time outside the
timed kernels (embedding, RoPE table, views, the Python between ops); "host" is the step's time
outside the model and the sampler. Prints a table per workload (ms per step and share); writes
results/step_profile.json.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter

from kvflow.model.linear import SMALL_PATHS, SMALL_ROWS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
KERNELS = {"paged_decode_attention": "attention", "paged_prefill_attention": "attention", "rms_norm": "norms/rope/silu",
           "add_rms_norm": "norms/rope/silu", "silu_mul": "norms/rope/silu", "rope_write": "norms/rope/silu"}


class Timers:
    """Seconds per category, accumulated by wrapped callables while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, fn, category):
        """`fn` timed under `category` (a string, or a function of fn's arguments returning one)."""
        def timed(*args, **kw):
            if not self.on:
                return fn(*args, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[category(*args) if callable(category) else category] += time.perf_counter() - t0
        return timed


@contextmanager
def instrumented(timers: Timers, model):
    """Timers around what a step calls, restored on exit."""
    from kvflow.engine import engine as engine_mod
    from kvflow.engine import runner as runner_mod
    from kvflow.model import cpu_kernels
    from kvflow.model.linear import Linear

    def projection(lin, x):
        path = "invariant" if lin.batch_invariant else lin.path(x.shape[0])
        return f"{'lm_head' if lin is model._lm_head else 'projections'} ({path})"

    saved = [(Linear, "__call__"), (runner_mod, "sample_requests"), (type(model), "forward"),
             (engine_mod.LLMEngine, "step")] + [(cpu_kernels, name) for name in KERNELS]
    originals = [getattr(owner, name) for owner, name in saved]
    Linear.__call__ = timers.wrap(Linear.__call__, projection)
    runner_mod.sample_requests = timers.wrap(runner_mod.sample_requests, "sampling")
    type(model).forward = timers.wrap(type(model).forward, "model")
    engine_mod.LLMEngine.step = timers.wrap(engine_mod.LLMEngine.step, "step")
    for name, category in KERNELS.items():
        setattr(cpu_kernels, name, timers.wrap(getattr(cpu_kernels, name), category))
    try:
        yield
    finally:
        for (owner, name), fn in zip(saved, originals):
            setattr(owner, name, fn)


def build(dtype: str, threads: int):
    from kvflow.config import EngineConfig, default_block_size
    from kvflow.engine.engine import LLMEngine
    from kvflow.engine.llm import OFFLINE_TOKEN_BUDGET
    from kvflow.model.llama import LlamaModel
    from kvflow.model.loader import load_checkpoint
    from kvflow.sched.scheduler import SchedulerConfig

    torch.set_num_threads(threads)
    ck = load_checkpoint(None)
    config = EngineConfig(dtype=dtype, block_size=default_block_size("cpu"), enable_prefix_caching=False, kv_cache_memory_gb=0.8,
                          scheduler=SchedulerConfig(max_num_batched_tokens=OFFLINE_TOKEN_BUDGET, max_num_seqs=256,
                                                    prefill_chunk_size=OFFLINE_TOKEN_BUDGET))
    engines = {}
    before = ",".join(p for p in SMALL_PATHS if p != "fixed")
    for name, det, paths in (("fast", False, None), ("fast, no fixed", False, before), ("deterministic", True, None)):
        if paths:
            os.environ["KVFLOW_LINEAR_PATHS"] = paths
        model = LlamaModel.from_state_dict(ck.config, ck.state_dict, dtype=getattr(torch, dtype), deterministic=det)
        os.environ.pop("KVFLOW_LINEAR_PATHS", None)
        assert model.batch_invariant == det
        engines[name] = LLMEngine(model, None, config)
        print(f"{name}: projection path by rows {_paths_by_rows(model)}", flush=True)
    return engines, ck.config.vocab_size


def _paths_by_rows(model) -> str:
    """Row ranges and the path each takes, e.g. "1-3 plain, 4-64 fixed, >128 prepacked"."""
    lin = model.layers[0].qkv
    if lin.batch_invariant:
        return "all fixed (invariant_linear)"
    spans: list[list] = []
    for n in range(1, SMALL_ROWS[-1] + 2):
        p = lin.path(n)
        if spans and spans[-1][2] == p:
            spans[-1][1] = n
        else:
            spans.append([n, n, p])
    return ", ".join(f"{a}-{b} {p}" if b <= SMALL_ROWS[-1] else f">{a - 1} {p}" for a, b, p in spans)


def profile(eng, prompts, temperature: float, steps: int, timers: Timers) -> tuple[list[dict], list[float]]:
    """Decode (`steps` > 0): once every prompt is in, `steps` pairs of steps, each a per-op step timed
    by `timers` (seconds per category) then a native one timed as a whole. Prefill (`steps` == 0):
    the prompts' step, timed by `timers` (the native loop is for decode steps only)."""
    from kvflow.sched.sampling import SamplingParams

    reqs = [eng.add_request(p, SamplingParams(max_tokens=2 * steps + 2, temperature=temperature, seed=i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    if steps > 0:
        while any(not r.output_token_ids for r in reqs):
            eng.step()
    per_op, native = [], []
    for _ in range(max(steps, 1)):
        eng.model.native_decode = False
        timers.seconds.clear()
        timers.on = True
        eng.step()
        timers.on = False
        per_op.append(dict(timers.seconds))
        eng.model.native_decode = eng.model.paged_kernel
        if steps > 0:
            t0 = time.perf_counter()
            eng.step()
            native.append(time.perf_counter() - t0)
    while eng.has_unfinished():
        eng.step()
    return per_op, native


def breakdown(samples: list[dict[str, float]]) -> dict[str, float]:
    """Median ms per category over steps, with "model other" and "host" derived per step."""
    rows = []
    for s in samples:
        s = dict(s)
        kernels = sum(v for k, v in s.items() if k not in ("model", "step", "sampling"))
        s["model other"] = s.get("model", 0.0) - kernels
        s["host"] = s["step"] - s.get("model", 0.0) - s.get("sampling", 0.0)
        rows.append(s)
    keys = sorted({k for r in rows for k in r})
    return {k: 1e3 * statistics.median(r.get(k, 0.0) for r in rows) for k in keys}


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model dtype")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64], help="decode batch sizes")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens of each decoding request")
    ap.add_argument("--prefill-len", type=int, default=1024, help="tokens of the prefill step's prompt")
    ap.add_argument("--temperature", type=float, default=1.0, help="decode sampling temperature")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats per workload")
    args = ap.parse_args()
    from kvflow.model import cpu_kernels

    engines, vocab = build(args.dtype, args.threads)
    rng = random.Random(0)
    loads = {f"decode b{b}": ([[rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(b)], args.steps)
             for b in args.batches}
    loads[f"prefill {args.prefill_len}"] = ([[rng.randrange(100, vocab) for _ in range(args.prefill_len)]], 0)
    timers = Timers()
    for eng in engines.values():  # warm-up: every shape once
        for prompts, steps in loads.values():
            with instrumented(timers, eng.model):
                profile(eng, prompts, args.temperature, min(steps, 1), timers)
    samples = {w: {e: {"profiled": [], "native": []} for e in engines} for w in loads}
    for rep in range(args.repeats):
        for w, (prompts, steps) in loads.items():
            for name in (list(engines) if rep % 2 == 0 else list(reversed(engines))):
                s = samples[w][name]
                with instrumented(timers, engines[name].model):
                    profiled, native = profile(engines[name], prompts, args.temperature, steps, timers)
                s["profiled"] += profiled
                s["native"] += native
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    isa = cpu_kernels.invariant_linear_isa(getattr(torch, args.dtype)) if cpu_kernels.available() else "none"
    cpu = _cpu_model()
    print(f"\n{cpu}, {args.dtype}, {args.threads} threads, invariant_linear {isa}, temperature {args.temperature}, "
          f"{args.repeats} repeats x {args.steps} decode steps (medians, ms per step)")
    table = {}
    for w in loads:
        table[w] = {}
        for name in engines:
            s = samples[w][name]
            b = breakdown(s["profiled"])
            if s["native"]:
                b["untimed step, native decode"] = 1e3 * statistics.median(s["native"])
            table[w][name] = b
        print(f"\n{w}")
        keys = [k for k in sorted(set().union(*(table[w][e] for e in engines))) if k not in ("step", "model")]
        print(f"  {'':<34}" + "".join(f"{e:>22}" for e in engines))
        table[w]["paths"] = {e: _paths_by_rows(engines[e].model) for e in engines}
        for k in keys + ["model", "step"]:
            cells = []
            for e in engines:
                v, total = table[w][e].get(k, 0.0), table[w][e]["step"]
                cells.append(f"{v:>12.1f} ms" + (f" {100 * v / total:>4.0f}%" if not k.startswith("untimed") else "      "))
            print(f"  {k:<34}" + "".join(f"{c:>22}" for c in cells))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "step_profile.json").write_text(json.dumps(
        {"config": vars(args), "cpu": cpu, "isa": isa, "machine": platform.machine(), "ms_per_step": table}, indent=2))
    print(f"\nwrote {RESULTS / 'step_profile.json'}")


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
