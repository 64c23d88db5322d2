"""GPU benchmark: kvflow on one CUDA device against `transformers` and against the memory floor.

    python benchmarks/gpu.py [--shapes 135m 1b] [--batches 1,16,32,64] [--out results/gpu]

Models are random-weight Llama checkpoints that `transformers` writes here (no hub, no network): the
SmolLM2-135M shape and a Llama-3.2-1B-like shape, bf16, vocab 49,152. For each shape, in one process:

- correctness: float32 greedy tokens (TF32 off) of kvflow and `transformers.generate` for prompts of
  5/37/130/300 random ids, and the bf16 last-token logits of kvflow against transformers' float32;
- decode attention alone at each batch size (CUDA only): the batch-invariant kernel against the
  split one, replayed from CUDA graphs;
- the decode step (`LLMEngine.step`, host work and sampling included) at each batch size, with CUDA
  graphs (the engine decoding ahead) and eager, as one synced step and as steps back to back (the
  steady-state time per token, which decoding ahead brings down to the graph replay), beside the
  floor: weight bytes + the KV bytes a step reads, over the device's measured copy bandwidth (bytes
  read + written by a device-to-device copy, per second); from the graph replays, what the device
  allows a pipeline on one GPU that splits the largest batch into two microbatches (their stages
  take turns on the device: replay(n) / (2 x replay(n/2)) of the engine's rate);
- a prompt step of 2,048 tokens (8 fresh 256-token prompts, eager as every prompt step is), and
  (CUDA) the host time of a Triton kernel's launch against a PyTorch op's;
- offline output tok/s (`LLM.generate`, 256 in / 128 out, `--offline-batch` requests) against
  `transformers.generate` eager with the same prompts (with `--compile`, also its static cache +
  `torch.compile`);
- (135M shape) the same requests sent at once to each serving backend, as the server runs them
  without HTTP, each in a fresh process: the engine, colocated depth 2, disaggregated (1, 1), the
  pipelines with their default KV replication and without it, a pipeline's median token step (round
  trip and compute); with `--baseline DIR`, each also on an older checkout's kvflow (needs pyzmq).

Writes a table to stdout and `gpu.json` (+ `gpu.png` with matplotlib) to --out. On a machine
without CUDA, `--device cpu --shapes tiny` runs the same code on a small model (a check of the
script, not a measurement to report).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter, int_list

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SHAPES = {  # hidden, intermediate, layers, heads, kv heads
    "135m": (576, 1536, 30, 9, 3),
    "1b": (2048, 8192, 16, 32, 8),
    "tiny": (64, 128, 2, 4, 2),
}
VOCAB = 49152
PROMPT_LENS = (5, 37, 130, 300)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def write_checkpoint(shape: str, directory: Path) -> Path:
    """A random-weight Llama checkpoint of `shape` in bf16 safetensors, as transformers writes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv_heads = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=VOCAB if shape != "tiny" else 512, hidden_size=hidden, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=2048, rope_theta=1e5, tie_word_embeddings=True,
                      initializer_range=0.04, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    path = directory / shape
    model.save_pretrained(path, safe_serialization=True)
    save_word_tokenizer(path, cfg.vocab_size)
    return path


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ids 0..vocab_size-1 ("<unk>", "<s>", "</s>", then "t3", "t4", ...):
    the server needs one to detokenize; the benchmark sends token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, vocab_size)]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(path)


def copy_bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves (read + written), median of 10."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times)


def prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def correctness(ckpt: Path, device: str, vocab: int) -> dict:
    from transformers import LlamaForCausalLM

    from kvflow.engine.llm import LLM
    from kvflow.model.batch import ForwardBatch
    from kvflow.sched.sampling import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ps = prompts(PROMPT_LENS, vocab)
    new = 32
    ref = LlamaForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32).to(device).eval()
    want, ref_logits = [], []
    with torch.inference_mode():
        for p in ps:
            ids = torch.tensor([p], device=device)
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                               min_new_tokens=new, pad_token_id=0)
            want.append(out[0, len(p):].tolist())
            ref_logits.append(ref(ids).logits[0, -1].float().cpu())
    del ref
    llm = LLM(str(ckpt), dtype="float32", device=device)
    got = [o.token_ids for o in llm.generate(ps, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True), use_tqdm=False)]
    identical = sum(g == w for g, w in zip(got, want))
    del llm
    bf = LLM(str(ckpt), dtype="bfloat16", device=device)
    eng, bs = bf.engine, bf.engine.kv_cache.layout.block_size
    worst = 0.0
    with torch.inference_mode():
        for p, r in zip(ps, ref_logits):
            batch = ForwardBatch.of([(len(p), len(p), list(range(-(-len(p) // bs))))], bs, device)
            logits = eng.model.forward(torch.tensor(p, device=device), batch, eng.kv_cache)[0].float().cpu()
            worst = max(worst, float((logits - r).abs().max() / r.abs().max()))
    del bf
    return {"fp32_identical_prompts": identical, "prompts": len(ps), "new_tokens": new,
            "bf16_logits_max_abs_err_over_max_abs": worst}


def decode_steps(ckpt: Path, device: str, batch: int, graphs: bool, vocab: int, steps: int, ahead: bool = True) -> dict:
    """Once `batch` requests (256-token prompts) all decode: the median wall time of one engine step
    between device syncs (`step_ms`: a step's latency, its host work and the device's in series), and
    the steady-state time per step (`steady_step_ms`: `steps` steps back to back, synced only at both
    ends, over `steps`: time per output token at batch 1). Decoding ahead (`decode_ahead`, CUDA
    graphs), a step's host work runs while the device computes the step it launched, which only the
    back-to-back figure shows (`ahead=False`: the engine one step at a time, for comparison)."""
    from kvflow.engine.llm import LLM
    from kvflow.sched.sampling import SamplingParams

    llm = LLM(str(ckpt), dtype="bfloat16", device=device, enforce_eager=not graphs, max_num_seqs=max(batch, 1),
              decode_ahead=ahead)
    eng = llm.engine
    params = SamplingParams(max_tokens=2 * steps + 8, temperature=0, ignore_eos=True)
    for p in prompts([256] * batch, vocab, seed=batch):
        eng.add_request(p, params)
    while any(not r.output_token_ids for r in eng.requests.values()):  # every prompt done
        eng.step()
    for _ in range(3):
        eng.step()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        eng.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(device)
    steady = (time.perf_counter() - t0) / steps
    fwd = forward_only(eng, device, steps)
    layout = eng.kv_cache.layout
    ctx = 256 + 3 + steps
    kv_bytes = batch * ctx * layout.bytes_per_block // layout.block_size
    result = {"batch": batch, "graphs": graphs and eng.runner.graphs is not None, "decode_ahead": eng.decode_ahead,
              "step_ms": 1e3 * statistics.median(times), "steady_step_ms": 1e3 * steady,
              "forward_ms": fwd, "weight_bytes": eng.model.weight_bytes, "kv_bytes": kv_bytes}
    fusion = eng.model.fusion  # which decode row counts took the fused projections, and the load-time measurement
    result["fusion"] = {"rows": sorted(fusion.rows), "why": fusion.why, "measured": [m._asdict() for m in fusion.measured]}
    if result["graphs"] and device == "cuda":  # the graph's device time alone (the last step, replayed)
        result["replay_ms"] = eng.runner.graphs.replay_ms(batch)
    del llm, eng
    if device == "cuda":
        torch.cuda.empty_cache()
    return result


def forward_only(eng, device: str, steps: int) -> float:
    """Median time of the step's forward alone (the graph replay, or the eager forward) at the
    running requests' current contexts, logits included, sampling and scheduling not: the rest of a
    step is host work. (It rewrites each request's last KV slot with the same values.)"""
    from kvflow.model.batch import ForwardBatch

    reqs = [r for r in eng.requests.values() if r.output_token_ids]
    contexts = [(r.num_tokens, list(r.block_ids)) for r in reqs]
    toks = [r.output_token_ids[-1] for r in reqs]
    graphs = eng.runner.graphs
    bs = eng.kv_cache.layout.block_size

    def once() -> None:
        with torch.inference_mode():
            if graphs is not None and len(reqs) <= graphs.max_batch:
                graphs.run(contexts, tokens=toks)
            else:
                batch = ForwardBatch.of([(1, c, b) for c, b in contexts], bs, device)
                eng.model.forward(torch.tensor(toks, device=device), batch, eng.kv_cache)

    once()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        once()
        sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def prompt_steps(ckpt: Path, device: str, vocab: int, reps: int = 5) -> dict:
    """Median wall time of an engine step that computes 8 fresh 256-token prompts (2,048 tokens, the
    server's default chunk budget; eager, as every prompt step is), and the host time a Triton kernel's
    launch from Python takes against a PyTorch op's: eager steps are launch-bound on a GPU."""
    from kvflow.engine.llm import LLM
    from kvflow.sched.sampling import SamplingParams

    llm = LLM(str(ckpt), dtype="bfloat16", device=device, max_num_seqs=8, max_num_batched_tokens=2048 + 8)
    eng = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    times = []
    for rep in range(reps + 1):
        ids = [eng.add_request(p, params).request_id for p in prompts([256] * 8, vocab, seed=100 + rep)]
        sync(device)
        t0 = time.perf_counter()
        eng.step()
        sync(device)
        if rep:  # (the first warms up)
            times.append(time.perf_counter() - t0)
        for rid in ids:
            eng.abort_request(rid)
    out = {"tokens": 2048, "step_ms": 1e3 * statistics.median(times)}
    del llm, eng
    if device == "cuda":
        from kvflow.model import triton_fused

        x = torch.randn(1, 576, dtype=torch.bfloat16, device=device)
        w = torch.ones(576, dtype=torch.bfloat16, device=device)
        out["launch_us"] = {"triton_rms_norm": _host_us(lambda: triton_fused.rms_norm(x, w, 1e-5)),
                            "torch_add": _host_us(lambda: x + x),
                            "torch_rms_norm": _host_us(lambda: torch.nn.functional.rms_norm(x, (576,), w, 1e-5))}
    return out


def _host_us(fn, n: int = 2000) -> float:
    """Host microseconds per call of `fn` (its launch, not its kernel's time)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return 1e6 * host


def profile_step(ckpt: Path, device: str, batch: int, graphs: bool, vocab: int, path: Path) -> None:
    """torch.profiler's table (top ops by device and by host time) of 5 decode steps, to `path`."""
    from torch.profiler import ProfilerActivity, profile

    from kvflow.engine.llm import LLM
    from kvflow.sched.sampling import SamplingParams

    llm = LLM(str(ckpt), dtype="bfloat16", device=device, enforce_eager=not graphs, max_num_seqs=max(batch, 1))
    eng = llm.engine
    for p in prompts([256] * batch, vocab, seed=batch):
        eng.add_request(p, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    while any(not r.output_token_ids for r in eng.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            eng.step()
        sync(device)
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    with path.open("a") as f:
        f.write(f"== batch {batch}, {'graphs' if graphs else 'eager'}, 5 steps\n")
        f.write(prof.key_averages().table(sort_by=key, row_limit=25) + "\n")
        f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25) + "\n")
    del llm, eng


def attention_kernels(shape: str, batches, context: int = 280, reps: int = 20) -> list[dict]:
    """Decode attention alone, per batch size: the batch-invariant kernel (`paged_attention`, what a
    deterministic model runs) against the split one (`paged_decode`, the default), each timed as
    `reps` launches replayed from one CUDA graph (launch overhead out), bf16, `context` keys per row
    in scattered 16-token blocks."""
    from kvflow.model import triton_attention as ta

    hidden, _, _, heads, kv_heads = SHAPES[shape]
    head_dim, bs = hidden // heads, 16
    rows = []
    for b in batches:
        per = -(-context // bs)
        g = torch.Generator(device="cuda").manual_seed(b)
        cache = torch.randn(2, b * per, bs, kv_heads, head_dim, generator=g, device="cuda").to(torch.bfloat16)
        table = torch.randperm(b * per, generator=g, device="cuda").view(b, per)
        q = torch.randn(b, heads, head_dim, generator=g, device="cuda").to(torch.bfloat16)
        idx = torch.arange(b, device="cuda")
        ctx = torch.full((b,), context, dtype=torch.long, device="cuda")
        outs = {name: torch.empty_like(q) for name in ("invariant", "split")}
        calls = {"invariant": lambda: ta.paged_attention(q, cache, table, idx, torch.ones_like(idx), ctx, 1, head_dim**-0.5,
                                                         outs["invariant"]),
                 "split": lambda: ta.paged_decode(q, cache, table, idx, ctx, head_dim**-0.5, outs["split"])}
        row = {"batch": b, "context": context, "parts": ta.decode_parts(b, kv_heads, torch.device("cuda"))}
        for name, call in calls.items():
            call()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(reps):
                    call()
            times = []
            for _ in range(10):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / reps)
            row[f"{name}_us"] = 1e3 * statistics.median(times)
        row["max_abs_diff"] = float((outs["invariant"].float() - outs["split"].float()).abs().max())
        rows.append(row)
    return rows


def offline(ckpt: Path, device: str, n: int, new: int, vocab: int, compile_hf: bool) -> dict:
    from transformers import LlamaForCausalLM

    from kvflow.engine.llm import LLM
    from kvflow.sched.sampling import SamplingParams

    ps = prompts([256] * n, vocab, seed=7)
    out = {"requests": n, "prompt": 256, "new_tokens": new}
    llm = LLM(str(ckpt), dtype="bfloat16", device=device, max_num_seqs=n)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    llm.generate(ps[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    res = llm.generate(ps, params, use_tqdm=False)
    sync(device)
    out["kvflow_tok_s"] = sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0)
    del llm, res
    hf = LlamaForCausalLM.from_pretrained(ckpt, torch_dtype=torch.bfloat16).to(device).eval()
    ids = torch.tensor(ps, device=device)
    mask = torch.ones_like(ids)

    def hf_run(**kw) -> float:
        with torch.inference_mode():
            hf.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, **kw)
            sync(device)
            t0 = time.perf_counter()
            hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)
            sync(device)
        return n * new / (time.perf_counter() - t0)

    out["transformers_eager_tok_s"] = hf_run()
    if compile_hf:
        try:
            hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
            out["transformers_compiled_tok_s"] = hf_run(cache_implementation="static")
        except Exception as e:  # (a transformers/torch pairing where it does not work: say so)
            out["transformers_compiled_error"] = f"{type(e).__name__}: {e}"[:300]
    return out


BACKENDS = ("engine", "engine-serial", "colocated-2", "colocated-2-whole-ahead", "colocated-2-no-replication",
            "disaggregated-1-1", "disaggregated-1-1-no-replication", "engine-again")


def backends(ckpt: Path, device: str, n: int, new: int, vocab: int, baseline: Path | None = None,
             timeout_s: float = 240.0, profile: Path | None = None) -> dict:
    """Output tok/s of `n` requests of 256 + `new` tokens sent at once to each serving backend (the
    server's `Backend`, without HTTP): the engine (decoding ahead where it has graphs; "-serial": one
    step at a time; "-again": once more, last, as the first process of a run on a GPU was slow twice
    for no known reason), colocated depth 2 (two microbatches of n/2 in flight, as a pipeline of depth
    2 is run; "-whole-ahead": one microbatch of n decoding ahead, `decode_ahead_depth=2`, so that the
    two stages on one GPU run n rows a step where two microbatches run n/2 twice, and a decode step's
    kernels are latency-bound, not row-bound; not in `BACKENDS`: "-ahead", two microbatches decoding
    ahead (as fast as serial on an H200, 2026-11-28), and "-frames", its hidden states on the step
    messages, `KVFLOW_HIDDEN_RINGS=0`), disaggregated (1, 1) (one token microbatch of n); the
    pipelines with their default KV replication (every step, for recovery) and without it; bf16.

    Each backend runs in a fresh process, as a server does: on the H200, the engine measured in this
    benchmark's own process (after the earlier parts) gave a quarter of what the same code gave in a
    fresh one (docs/results.md, 2026-11-27). With `baseline` (another checkout's root), each backend
    also runs on that tree's `kvflow`, right before this tree's (figures prefixed `baseline_`): lent
    machines differ, so a change is measured against its alternative in one run."""
    try:
        import zmq  # noqa: F401  (the pipelines' transport)
    except ImportError:
        return {"skipped": "pyzmq is not installed (scripts/gpu_check.sh says how to carry it)"}
    out = {"requests": n, "prompt": 256, "new_tokens": new}
    trees = ([("baseline_", baseline.resolve())] if baseline is not None else []) + [("", ROOT)]
    for name in BACKENDS:
        for prefix, tree in trees:
            got = _serve_in(tree, [str(ckpt), device, str(n), str(new), str(vocab), name], timeout_s, profile)
            if "tok_s" in got:
                out.update({f"{prefix}{name}_{k}": v for k, v in got.items()})
            else:
                out[f"{prefix}{name}_error"] = got.get("error", "no answer")
    return out


ROOT = Path(__file__).resolve().parent.parent


def _serve_in(tree: Path, args: list[str], timeout_s: float, profile: Path | None = None) -> dict:
    """`_serve` in a fresh interpreter whose `kvflow` is `tree`'s (its root the working directory and
    first on the path, so the pipelines' worker processes import the same one): its JSON line. With
    `profile` (a directory) and py-spy on the path, the process and its workers are sampled (CPU
    time only, not idle waits) and `profile`/serve-NAME.txt gets each process's busiest frames."""
    import shutil
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, __file__, "--serve-one", *args]
    spy = shutil.which("py-spy") if profile is not None else None
    raw = profile / f"serve-{args[-1]}.raw" if spy else None
    if raw is not None:
        cmd = [spy, "record", "--subprocesses", "--nonblocking", "--rate", "250", "--format", "raw", "--output", str(raw), "--", *cmd]
    try:
        run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout_s:.0f} s"}
    if raw is not None and raw.is_file():
        raw.with_suffix(".txt").write_text(busiest_frames(raw.read_text()))
        raw.unlink()
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode or not lines:
        return {"error": f"exit {run.returncode}: {(run.stderr or run.stdout).strip()[-300:]}"}
    return json.loads(lines[-1])


def busiest_frames(raw: str, top: int = 40) -> str:
    """py-spy's raw output (one "frame;frame;... count" line per stack, a process's frames after its
    "process PID:..." frame) as each process's samples and its `top` frames by the samples they were
    on the stack of (inclusive), busiest process first. Stacks in an import are left out (start-up)."""
    from collections import Counter

    per: dict[str, Counter] = {}
    totals: Counter = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit() or "<frozen importlib" in stack:
            continue
        frames = stack.split(";")
        at = max((i for i, f in enumerate(frames) if f.startswith("process ")), default=-1)
        proc = frames[at] if at >= 0 else "process ?"
        totals[proc] += int(n)
        seen = per.setdefault(proc, Counter())
        for f in set(frames[at + 1:]):
            seen[f] += int(n)
    out = []
    for proc, total in totals.most_common():
        out.append(f"== {proc[:160]}: {total} samples")
        out += [f"{c:7d} {100 * c / total:5.1f}%  {f[:150]}" for f, c in per[proc].most_common(top)]
    return "\n".join(out) + "\n"


def _serve(ckpt: str, device: str, n: int, new: int, vocab: int, name: str) -> dict:
    """One backend of `BACKENDS`: a warm-up run of `n` other prompts, the timed run's shapes (its
    prompt chunks, decode batches and context lengths: a fresh process compiles what the Triton
    cache lacks, and nothing may compile while timed), then `n` at once; output tok/s, the seconds
    until every request had its first token, and, for a
    pipeline, the median token step (a batch of at most `n` tokens) of the pipeline that decodes: its
    round trip as the controller saw it, its compute summed over the stages, in ms, the steps its
    stages launched on the device behind the one before (`worker.compute`), and the controller's
    loop thread's CPU per step and over the wall time (near 1: the controller bounds the pipeline)."""
    import asyncio

    from kvflow.config import ClusterConfig, EngineConfig
    from kvflow.controller.controller import Controller
    from kvflow.sched.config import SchedulerConfig
    from kvflow.sched.sampling import SamplingParams
    from kvflow.serving.backend import EngineBackend

    engine = EngineConfig(model=ckpt, dtype="bfloat16", device=device, block_size=16, num_kv_blocks=4096,
                          scheduler=SchedulerConfig(max_num_seqs=n))
    name = name.removesuffix("-again")  # (the engine once more, last: the first process of a run was slow twice on GPUs)
    serial = name.endswith("-serial")  # (`ClusterConfig.decode_ahead`, the engine's `EngineConfig.decode_ahead`, off)
    name = name.removesuffix("-serial")
    if name.endswith("-frames"):  # hidden states on the step messages, not through the shared-memory rings
        os.environ["KVFLOW_HIDDEN_RINGS"] = "0"
        name = name.removesuffix("-frames")
    deep = {"decode_ahead_depth": 2} if name.endswith("-ahead") else {}  # (a depth-2 pipeline decoding ahead: opt-in)
    name = name.removesuffix("-ahead")
    microbatches = 1 if name.endswith("-whole") else 2
    name = name.removesuffix("-whole")
    replication = "none" if name.endswith("-no-replication") else "ring"
    if name == "engine":
        backend = EngineBackend.from_config(dataclasses.replace(engine, decode_ahead=not serial))
    elif name.startswith("colocated-2"):
        backend = Controller(ClusterConfig(engine=engine, mode="colocated", depth=2, microbatch_size=-(-n // microbatches),
                                           replication=replication, **({"decode_ahead": False} if serial else deep)))
    else:
        backend = Controller(ClusterConfig(engine=engine, mode="disaggregated", prompt_depth=1, token_depth=1,
                                           microbatch_size=n, prompt_microbatch_size=n, replication=replication,
                                           **({"decode_ahead": False} if serial else {})))
    ps = prompts([256] * n, vocab, seed=11)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)

    first: list[float] = []  # when each timed request had its first token

    async def one(p, rid, timed=True) -> int:
        got = 0
        async for out in backend.generate(p, params, rid):
            if timed and not got and out.new_token_ids:
                first.append(time.perf_counter())
            got += len(out.new_token_ids)
        return got

    async def run() -> dict:
        await backend.start()
        try:
            others = prompts([256] * n, vocab, seed=12)  # (other tokens: the prefix cache must not serve the timed prompts)
            await asyncio.gather(*[one(p, f"warm{i}", timed=False) for i, p in enumerate(others)])
            log = backend.pipelines[-1].step_log if name != "engine" else None
            before = len(log) if log is not None else 0
            cpu_before = getattr(backend, "loop_cpu_s", 0.0)
            t0 = time.perf_counter()
            got = await asyncio.gather(*[one(p, f"r{i}") for i, p in enumerate(ps)])
            wall = time.perf_counter() - t0
            result = {"tok_s": sum(got) / wall, "all_first_tokens_s": max(first) - t0}
            if log is not None:  # how busy a stage of the pipelines was: their steps' compute over the stages and the wall time
                stages = sum(p.depth for p in backend.pipelines)
                result["stage_busy_fraction"] = sum(r[1] for r in list(log)[before:]) / stages / wall
            handles = getattr(backend, "stages", None)
            if handles:  # steps a one-stage pipeline launched behind the one before: from a heartbeat sent after the run
                done, deadline = time.monotonic(), time.monotonic() + 10
                while any(s.last_heartbeat <= done for s in handles.values()) and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                result["launched_ahead"] = sum(getattr(s, "launched_ahead", 0) for s in handles.values())
            workers = getattr(backend, "workers", None)
            if workers is not None and hasattr(workers, "rings"):  # hidden states through shared memory or on the messages
                result["hidden_rings_mapped"] = sum(s.hidden_shm for s in backend.stages.values())
            store = getattr(backend, "store", None)
            if store is not None:  # where the replicas went: shared-memory segments written in place, or the KV port
                result.update(replica_segments=len(getattr(store, "segments", ())), replica_port_bytes=store.nbytes)
            token_steps = [r for r in list(log)[before:] if r[0] <= n] if log is not None else []  # (tokens, busy[, trip])
            if token_steps:
                result["token_step_compute_ms"] = 1e3 * statistics.median(r[1] for r in token_steps)
                # the controller's loop thread: its CPU per step (every step of the run) and over the wall time
                steps = len(log) - before
                result["controller_cpu_ms_per_step"] = 1e3 * (backend.loop_cpu_s - cpu_before) / max(1, steps)
                result["controller_busy_fraction"] = (backend.loop_cpu_s - cpu_before) / wall
                if len(token_steps[0]) > 2:  # (a baseline tree's log may not time round trips)
                    result["token_step_round_trip_ms"] = 1e3 * statistics.median(r[2] for r in token_steps)
            return result
        finally:
            await backend.shutdown()

    return asyncio.run(run())


def main() -> None:
    if sys.argv[1:2] == ["--serve-one"]:  # (one serving backend, in its own process: `backends`)
        ckpt, device, n, new, vocab, name = sys.argv[2:8]
        try:
            print(json.dumps(_serve(ckpt, device, int(n), int(new), int(vocab), name)), flush=True)
        except Exception as e:  # one layout failing must not hide the others' figures
            print(json.dumps({"error": f"{type(e).__name__}: {e}"[:300]}), flush=True)
        return
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="where to run (cpu: a check of the script only)")
    ap.add_argument("--shapes", nargs="+", default=["135m", "1b"], choices=sorted(SHAPES), help="model shapes to measure")
    ap.add_argument("--batches", type=int_list, default=(1, 16, 32, 64), help="decode batch sizes, comma-separated")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per batch size")
    ap.add_argument("--offline-batch", type=int, default=64, help="requests in the offline run (256 in each)")
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request in the offline run")
    ap.add_argument("--compile", action="store_true", help="also time transformers with a static cache and torch.compile")
    ap.add_argument("--profile", action="store_true", help="also write profile-<shape>.txt: 5 decode steps at batch 1 and the "
                    "largest batch, eager and graphed, under torch.profiler")
    ap.add_argument("--profile-serving", action="store_true", help="sample each serving backend's processes with py-spy "
                    "(where it is on the path) and write serve-<backend>.txt: each process's busiest frames")
    ap.add_argument("--out", type=Path, default=Path("results/gpu"), help="directory for gpu.json and gpu.png")
    ap.add_argument("--baseline", type=Path, help="another kvflow checkout's root: each serving backend also runs on it, "
                    "alternating with this tree's (e.g. `git worktree add /tmp/base <commit>`)")
    args = ap.parse_args()
    if args.baseline is not None and not (args.baseline / "kvflow" / "__init__.py").is_file():
        ap.error(f"--baseline {args.baseline}: not a kvflow checkout (no kvflow/__init__.py there)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here (use --device cpu --shapes tiny to check the script)")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda, "shapes": {}}
    bw = copy_bandwidth(args.device)
    report["copy_bytes_per_s"] = bw
    print(f"device {report['device']}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            t0 = time.perf_counter()
            ckpt = write_checkpoint(shape, Path(tmp))
            vocab = VOCAB if shape != "tiny" else 512
            r: dict = {"correctness": correctness(ckpt, args.device, vocab)}
            print(f"[{shape}] correctness {r['correctness']}", flush=True)
            r["decode"] = []
            for b in args.batches:
                for graphs in (True, False):
                    d = decode_steps(ckpt, args.device, b, graphs, vocab, args.steps)
                    d["floor_ms"] = 1e3 * (d["weight_bytes"] + d["kv_bytes"]) / bw
                    r["decode"].append(d)
                    print(f"[{shape}] decode batch {b:3d} {'graphs' if d['graphs'] else 'eager ':6s} "
                          f"{'ahead' if d['decode_ahead'] else 'serial'}: one synced step {d['step_ms']:8.3f} ms, back to back "
                          f"{d['steady_step_ms']:8.3f} ms/step (forward {d['forward_ms']:.3f})  floor {d['floor_ms']:.3f} ms  "
                          f"x{d['steady_step_ms'] / d['floor_ms']:.1f}"
                          + (f"  replay {d['replay_ms']:.3f} ms, fused projections: {b in d['fusion']['rows']} "
                             f"({d['fusion']['why']})" if "replay_ms" in d else ""), flush=True)
            replay = {d["batch"]: d["replay_ms"] for d in r["decode"] if "replay_ms" in d}
            n = max(args.batches)
            if n in replay and n // 2 in replay:  # (one GPU: the two microbatches' steps take turns on it)
                r["two_microbatch_ceiling"] = replay[n] / (2 * replay[n // 2])
                print(f"[{shape}] a pipeline of two microbatches of {n // 2} on one GPU: at most "
                      f"x{r['two_microbatch_ceiling']:.2f} of one batch of {n}'s rate (graph replays)", flush=True)
            if args.device == "cuda":
                try:
                    r["attention"] = attention_kernels(shape, args.batches)
                except Exception as e:  # (a kernel that fails here must not cost the run its other figures)
                    r["attention"] = [{"error": f"{type(e).__name__}: {e}"[:300]}]
                for a in r["attention"]:
                    print(f"[{shape}] decode attention " + (f"batch {a['batch']:3d}: invariant {a['invariant_us']:.1f} us, "
                          f"split ({a['parts']} parts) {a['split_us']:.1f} us" if "error" not in a else f"failed: {a['error']}"), flush=True)
            r["prompt_step"] = prompt_steps(ckpt, args.device, vocab)
            print(f"[{shape}] prompt step {r['prompt_step']}", flush=True)
            if args.profile:
                for b in sorted({args.batches[0], args.batches[-1]}):
                    for graphs in (False, True):
                        try:
                            profile_step(ckpt, args.device, b, graphs, vocab, args.out / f"profile-{shape}.txt")
                        except Exception as e:  # (the profile is a diagnosis: the figures go on without it)
                            print(f"[{shape}] profile batch {b} failed: {type(e).__name__}: {e}", flush=True)
            r["offline"] = offline(ckpt, args.device, args.offline_batch, args.new_tokens, vocab, args.compile)
            print(f"[{shape}] offline {r['offline']}", flush=True)
            if shape != "1b":  # (the serving figure is the 135M shape's)
                r["backends"] = backends(ckpt, args.device, args.offline_batch, args.new_tokens, vocab, args.baseline,
                                         profile=args.out if args.profile_serving else None)
                print(f"[{shape}] backends {r['backends']}", flush=True)
            r["seconds"] = time.perf_counter() - t0
            report["shapes"][shape] = r
            (args.out / "gpu.json").write_text(json.dumps(report, indent=2))  # after each shape: a timeout keeps what ran
    plot(report, args.out / "gpu.png")
    print(f"wrote {args.out / 'gpu.json'}")


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'kvflow[plot]')")
        return
    shapes = list(report["shapes"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = report["shapes"][shape]["decode"]
        batches = sorted({d["batch"] for d in rows})
        for graphs, style in ((True, "o-"), (False, "s--")):
            ms = [next(d["step_ms"] for d in rows if d["batch"] == b and d["graphs"] == graphs) for b in batches
                  if any(d["batch"] == b and d["graphs"] == graphs for d in rows)]
            if len(ms) == len(batches):
                ax.plot(batches, ms, style, label="CUDA graphs" if graphs else "eager")
        floor = [next(d["floor_ms"] for d in rows if d["batch"] == b) for b in batches]
        ax.plot(batches, floor, "k:", label="memory floor")
        ax.set(title=f"{shape}: decode step", xlabel="batch", ylabel="ms", xscale="log", yscale="log")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
