"""Offline throughput, kvflow against vLLM's CPU backend: same weights, dtype, cores and prompts, interleaved.

    python benchmarks/offline.py [--batches 1 4 16] [--new-tokens 64] [--prefill-len 256] [--repeats 3]

kvflow's `LLM` runs in this process; vLLM's `LLM` runs in a long-lived child process started with
the peer's Python (`vllm-cpu-peer.sh python`, its own venv; the tool found with --peer-tool,
$KVFLOW_PEER_TOOL, or as `shared/tools/vllm-cpu-peer.sh` in the checkout's folder or one above it), in-process engine
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), which this script drives over a pipe and pauses (SIGSTOP)
while kvflow is measured. Both load kvflow's converted copy of the default model, with prefix
caching off (the same prompts come back every repeat) and each side's default scheduler settings.
Prompts are random token ids (seed 0). Measured, each repeat alternating which side goes first:

- decode tok/s at each batch: (time to generate N tokens - time to generate 1) per decoded token,
  as benchmarks/engine.py does, so prefill is excluded;
- prefill tok/s: 4 prompts of --prefill-len tokens, one output token.

Prints medians and kvflow / vLLM ratios; writes results/offline.json. Without the peer (or with
--no-vllm), kvflow only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(batch)]


# ---------------------------------------------------------------------------------- vLLM child
def vllm_worker(model_dir: str, dtype: str) -> None:
    """Reads {"prompts": [[ids]], "max_tokens": n} lines on stdin, answers {"seconds": t, "tokens": k}."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out = os.fdopen(os.dup(1), "w")  # the protocol's channel; everything vLLM prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=2048, seed=0, enable_prefix_caching=False)
    print(json.dumps({"ready": True, "torch_threads": torch.get_num_threads(),
                      "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens}),
          file=out, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        p = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True, temperature=0)
        t0 = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]], p, use_tqdm=False)
        dt = time.perf_counter() - t0
        print(json.dumps({"seconds": dt, "tokens": sum(len(r.outputs[0].token_ids) for r in res)}), file=out, flush=True)


class VLLMChild:
    def __init__(self, peer: Path, model_dir: str, dtype: str, log: Path) -> None:
        cmd = ["bash", str(peer), "python", __file__, "--vllm-worker", model_dir, "--dtype", dtype]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(log, "w"),
                                     text=True, start_new_session=True)
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"the vLLM child exited ({self.proc.wait()}); see {log}")
        self.info = json.loads(hello)
        self.pause()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def pause(self) -> None:
        self.signal(signal.SIGSTOP)

    def run(self, ids: list[list[int]], max_tokens: int) -> float:
        self.signal(signal.SIGCONT)
        try:
            self.proc.stdin.write(json.dumps({"prompts": ids, "max_tokens": max_tokens}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("the vLLM child died")
            res = json.loads(line)
        finally:
            self.pause()
        assert res["tokens"] == len(ids) * max_tokens, res
        return res["seconds"]

    def close(self) -> None:
        self.signal(signal.SIGCONT)
        self.proc.stdin.close()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)


# ---------------------------------------------------------------------------------- main
class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16], help="decode batch sizes")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per decode run")
    ap.add_argument("--decode-prompt-len", type=int, default=64, help="prompt tokens of the decode runs")
    ap.add_argument("--prefill-len", type=int, default=256, help="prompt tokens of each of the 4 prefill prompts")
    ap.add_argument("--repeats", type=int, default=3, help="repeats, the side going first alternating (medians)")
    ap.add_argument("--threads", type=int, default=2, help="kvflow's torch threads")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="both sides' dtype "
                    "(auto: bfloat16 where the CPU has native bf16, else float32)")
    ap.add_argument("--no-vllm", action="store_true", help="kvflow only, even if the peer is installed")
    ap.add_argument("--peer-tool", default=None, help="path of vllm-cpu-peer.sh; None: $KVFLOW_PEER_TOOL, else "
                    "shared/tools/vllm-cpu-peer.sh in the checkout's folder or one above it")
    ap.add_argument("--vllm-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.vllm_worker:
        return vllm_worker(args.vllm_worker, args.dtype)

    import torch

    from kvflow import LLM, SamplingParams
    from kvflow.bench import peer as peer_tool
    from kvflow.config import resolve_dtype
    from kvflow.model.loader import load_config

    torch.set_num_threads(args.threads)
    dtype, why = resolve_dtype(args.dtype)
    mc, model_dir = load_config(None)
    RESULTS.mkdir(exist_ok=True)
    llm = LLM(dtype=dtype, num_threads=args.threads, enable_prefix_caching=False)
    sched = llm.engine.config.scheduler
    print(f"kvflow: {dtype} ({why}), {args.threads} threads, budget {sched.max_num_batched_tokens} tokens / "
          f"chunk {sched.prefill_chunk_size}", flush=True)
    vllm = None
    if not args.no_vllm:
        try:
            peer = peer_tool.require(args.peer_tool, ROOT)[0]
        except peer_tool.PeerMissing as e:
            print(f"{e}: kvflow only", flush=True)
        else:
            vllm = VLLMChild(peer, str(model_dir), dtype, RESULTS / "offline-vllm.log")
            print(f"vLLM-CPU: {dtype}, child torch threads {vllm.info['torch_threads']}, "
                  f"max_num_batched_tokens {vllm.info['max_num_batched_tokens']}", flush=True)
    else:
        print("--no-vllm: kvflow only", flush=True)

    def kvflow_run(ids: list[list[int]], max_tokens: int) -> float:
        p = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(ids, p, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert all(len(o.token_ids) == max_tokens for o in outs)
        return dt

    sides = {"kvflow": kvflow_run} | ({"vllm": vllm.run} if vllm else {})
    jobs = {f"decode b={b}": (prompts(b, args.decode_prompt_len, mc.vocab_size, b), args.new_tokens) for b in args.batches}
    jobs["prefill"] = (prompts(4, args.prefill_len, mc.vocab_size, 99), 1)
    times: dict[tuple[str, str, int], list[float]] = {}
    try:
        for ids, n in jobs.values():  # warm-up
            for run in sides.values():
                run(ids, min(n, 2))
        for rep in range(args.repeats):
            for job, (ids, n) in jobs.items():
                order = list(sides) if rep % 2 == 0 else list(reversed(sides))
                for side in order:
                    for k in ((n, 1) if job != "prefill" else (1,)):
                        times.setdefault((job, side, k), []).append(sides[side](ids, k))
            print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    finally:
        if vllm:
            vllm.close()

    rows = []
    for job, (ids, n) in jobs.items():
        row: dict = {"job": job}
        for side in sides:
            if job == "prefill":
                row[side] = len(ids) * args.prefill_len / statistics.median(times[(job, side, 1)])
            else:
                dt = statistics.median(times[(job, side, n)]) - statistics.median(times[(job, side, 1)])
                row[side] = len(ids) * (n - 1) / dt
        row["ratio"] = row["kvflow"] / row["vllm"] if "vllm" in row else None
        rows.append(row)
    print(f"\n{'':<12} {'kvflow tok/s':>13} {'vLLM tok/s':>11} {'kvflow/vLLM':>12}   ({dtype}, {args.threads} threads, "
          f"median of {args.repeats})")
    for r in rows:
        v = f"{r['vllm']:>11.1f}" if "vllm" in r else f"{'-':>11}"
        ratio = f"x{r['ratio']:.2f}" if r["ratio"] else "-"
        print(f"{r['job']:<12} {r['kvflow']:>13.1f} {v} {ratio:>12}")
    doc = {"config": vars(args), "dtype": dtype, "kvflow_scheduler": vars(sched) if hasattr(sched, "__dict__") else str(sched),
           "vllm": vllm.info if vllm else None, "rows": rows,
           "times": {f"{j}|{s}|{k}": v for (j, s, k), v in times.items()}}
    (RESULTS / "offline.json").write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {RESULTS / 'offline.json'}")


if __name__ == "__main__":
    main()
