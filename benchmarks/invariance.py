"""What batch invariance costs: the same engine with `deterministic` on and off, interleaved in one process.

    python benchmarks/invariance.py [--dtype bfloat16] [--threads 2] [--repeats 5]

Two `LLMEngine`s over the embedded SmolLM2-135M (one `LlamaModel` built with deterministic=True:
every projection on `invariant_linear`, decode rows through the prefill attention kernel; one with
False: the per-row-count fastest paths, oneDNN and the decode kernel), each repeat running every
workload on both, alternating which goes first. Workloads (random token ids, greedy, ignore_eos,
prefix caching off):

- decode tok/s at batch 1, 4 and 16 after 64-token prompts, and at batch 16 after 1024-token
  prompts: batch / the median time of an engine step once every prompt is in (--new-tokens steps);
- prefill tok/s: 4 prompts of 256 tokens, one output token each (the steps until they are done);
- mixed: 48 requests, prompts of 16-768 tokens and outputs of 8-128, all submitted at once
  (continuous batching with chunked prefill: the offline throughput users see), tokens in and out
  per second of the whole run.

Per-step medians, not (N tokens - 1 token) differences: on a VM shared with other jobs a difference
of two totals swung by 10x. `--clock cpu` (with `--threads 1`) times by the thread's CPU time, which
a job on the other core cannot stretch by taking this one's core away. Prints medians and deterministic / fast ratios (per repeat, then the
median of those); writes results/invariance.json.
"""

from __future__ import annotations

import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
CLOCK = time.perf_counter  # or time.thread_time (--clock cpu)


def build(dtype: str, threads: int):
    from kvflow.config import EngineConfig, default_block_size
    from kvflow.engine.engine import LLMEngine
    from kvflow.engine.llm import LLM, OFFLINE_TOKEN_BUDGET
    from kvflow.model.llama import LlamaModel
    from kvflow.model.loader import load_checkpoint
    from kvflow.model.tokenizer import Tokenizer
    from kvflow.sched.scheduler import SchedulerConfig

    torch.set_num_threads(threads)
    ck = load_checkpoint(None)
    tok = Tokenizer(ck.directory)
    config = EngineConfig(dtype=dtype, block_size=default_block_size("cpu"), enable_prefix_caching=False,
                          kv_cache_memory_gb=1.0,
                          scheduler=SchedulerConfig(max_num_batched_tokens=OFFLINE_TOKEN_BUDGET, prefill_chunk_size=OFFLINE_TOKEN_BUDGET))
    llms = {}
    for name, det in (("deterministic", True), ("fast", False)):
        model = LlamaModel.from_state_dict(ck.config, ck.state_dict, dtype=getattr(torch, dtype), deterministic=det)
        assert model.batch_invariant == det, f"{name}: batch_invariant is {model.batch_invariant}"
        llms[name] = LLM.from_engine(LLMEngine(model, tok, config))
    return llms, ck.config.vocab_size


def ids(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run(llm, prompts, max_tokens) -> float:
    from kvflow.sched.sampling import SamplingParams

    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens]
    t0 = CLOCK()
    llm.generate(prompts, params, use_tqdm=False)
    return CLOCK() - t0


def decode_step_seconds(llm, prompts, steps: int) -> float:
    """The median time of an engine step of len(prompts) decode rows, after every prompt is in."""
    from kvflow.sched.sampling import SamplingParams

    eng = llm.engine
    reqs = [eng.add_request(p, SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)) for p in prompts]
    while any(not r.output_token_ids for r in reqs):
        eng.step()
    times = []
    for _ in range(steps):
        t0 = CLOCK()
        eng.step()
        times.append(CLOCK() - t0)
    while eng.has_unfinished():
        eng.step()
    return statistics.median(times)


def workloads(vocab: int, new_tokens: int) -> dict:
    """name -> (prompts, max_tokens list, how to turn (seconds of N tokens, seconds of 1 token) into tok/s)."""
    rng = random.Random(1)
    mixed = [[rng.randrange(100, vocab) for _ in range(rng.randint(16, 768))] for _ in range(48)]
    out = {}
    for b, ctx in ((1, 64), (4, 64), (16, 64), (16, 1024)):
        out[f"decode b{b} ctx{ctx}"] = ("decode", ids(b, ctx, vocab, b + ctx), b)
    out["prefill 4x256"] = ("prefill", ids(4, 256, vocab, 7), 4 * 256)
    out["mixed 48 req"] = ("mixed", mixed, [rng.randint(8, 128) for _ in mixed])
    return out


def measure(llm, kind: str, prompts, arg, new_tokens: int) -> float:
    """tok/s of one workload on one engine."""
    if kind == "decode":
        return arg / decode_step_seconds(llm, prompts, new_tokens)
    if kind == "prefill":
        return arg / run(llm, prompts, [1] * len(prompts))
    return (sum(len(p) for p in prompts) + sum(arg)) / run(llm, prompts, arg)


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="model dtype")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per workload (medians)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per request")
    ap.add_argument("--only", default=None, help="comma-separated workload names (default: all)")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"], help="cpu: the thread's CPU time (needs --threads 1)")
    args = ap.parse_args()
    if args.clock == "cpu":
        if args.threads != 1:
            ap.error("--clock cpu counts the calling thread only: use it with --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    from kvflow.model import cpu_kernels

    llms, vocab = build(args.dtype, args.threads)
    isa = cpu_kernels.invariant_linear_isa(getattr(torch, args.dtype)) if cpu_kernels.available() else "none"
    loads = workloads(vocab, args.new_tokens)
    if args.only:
        loads = {k: v for k, v in loads.items() if k in args.only.split(",")}
    for name, llm in llms.items():  # warm-up: every shape once
        for kind, prompts, arg in loads.values():
            run(llm, prompts[:2], [2] * len(prompts[:2]))
    samples: dict[str, dict[str, list[float]]] = {w: {n: [] for n in llms} for w in loads}
    for rep in range(args.repeats):
        order = list(llms) if rep % 2 == 0 else list(reversed(llms))
        for w, (kind, prompts, arg) in loads.items():
            for name in order:
                samples[w][name].append(measure(llms[name], kind, prompts, arg, args.new_tokens))
        print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(
            f"{w} {samples[w]['deterministic'][-1] / samples[w]['fast'][-1]:.3f}" for w in loads), flush=True)
    print(f"\n{args.dtype}, {args.threads} threads, {args.clock} clock, invariant_linear isa {isa}, {args.repeats} repeats "
          "(medians, tok/s)")
    print(f"{'workload':<20}{'deterministic':>15}{'fast':>10}{'ratio':>8}{'ratio range':>16}")
    table = {}
    for w in loads:
        det, fast = samples[w]["deterministic"], samples[w]["fast"]
        ratios = [d / f for d, f in zip(det, fast)]
        table[w] = {"deterministic": statistics.median(det), "fast": statistics.median(fast),
                    "ratio": statistics.median(ratios), "ratios": ratios, "samples": samples[w]}
        print(f"{w:<20}{table[w]['deterministic']:>15.1f}{table[w]['fast']:>10.1f}{table[w]['ratio']:>8.3f}"
              f"{min(ratios):>8.3f}-{max(ratios):.3f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "invariance.json").write_text(json.dumps(
        {"config": vars(args), "isa": isa, "machine": platform.processor() or platform.machine(), "results": table}, indent=2))
    print(f"wrote {RESULTS / 'invariance.json'}")


if __name__ == "__main__":
    main()
