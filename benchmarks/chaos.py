"""Chaos: SIGKILL a random worker at a random moment while requests stream, many times.

One cluster per layout (colocated depth 2 and 3, disaggregated (1,1), (1,2), (2,2)) of real
worker processes, on a 4-layer random-weight model (what is checked is the mechanism, not the
model: a tiny model makes 100+ trials fit in minutes). Each trial streams a set of requests (greedy
and seeded) and, once a random number of tokens has been streamed (an event, not a timer), kills a
random worker of a random role; the trial passes when every request completes with exactly the
tokens of the failure-free reference (`LLMEngine` in-process): none missing, none duplicated, the
same seeded samples. The killed worker is replaced by the recovery, so the next trial runs on the
recovered cluster. Reports per dtype and layout: trials, passes, resumed vs recomputed requests,
recovery time. Writes results/chaos.json and results/chaos.png.

The trials run in every dtype of `--dtypes`: by default bfloat16 where the CPU has native bf16 (the
dtype `auto` picks, so the one users run) and float32; float32 alone elsewhere. `--trials` is per
dtype. The engine and the workers are batch-invariant (`EngineConfig.deterministic`): the reference
engine batches the requests differently from the pipelines, and in bf16 only batch-invariant kernels
make their tokens the same.

    python benchmarks/chaos.py [--trials 100] [--dtypes bfloat16,float32] [--seed 0]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvflow.cli.args import ArgumentParser, RawDescriptionHelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
sys.path.insert(0, str(ROOT / "tests"))  # the random-weight model builders the test-suite uses

LAYOUTS = {
    "colocated-2": dict(mode="colocated", depth=2),
    "colocated-3": dict(mode="colocated", depth=3),
    "disagg-1-1": dict(mode="disaggregated", prompt_depth=1, token_depth=1),
    "disagg-1-2": dict(mode="disaggregated", prompt_depth=1, token_depth=2),
    "disagg-2-2": dict(mode="disaggregated", prompt_depth=2, token_depth=2),
}
PROMPTS = [[3, 30, 31, 4], [5, 9, 11], [7] * 10, list(range(40, 52)), [8, 8, 9], list(range(60, 66))]
LENGTHS = [40, 25, 60, 35, 50, 45]
SEEDED = {1: 11, 4: 29}


def params(i: int):
    from kvflow.sched.sampling import SamplingParams

    if i in SEEDED:
        return SamplingParams(max_tokens=LENGTHS[i], temperature=0.8, seed=SEEDED[i], ignore_eos=True)
    return SamplingParams(max_tokens=LENGTHS[i], temperature=0, ignore_eos=True)


def reference(model_cfg, dtype: str) -> list[list[int]]:
    import torch
    from conftest import run_to_completion, tiny_state_dict

    from kvflow.config import EngineConfig
    from kvflow.engine.engine import LLMEngine
    from kvflow.model.llama import LlamaModel

    model = LlamaModel.from_state_dict(model_cfg, tiny_state_dict(model_cfg), dtype=getattr(torch, dtype), deterministic=True)
    eng = LLMEngine(model, None, EngineConfig(dtype=dtype, num_kv_blocks=256, block_size=4, deterministic=True))
    reqs = [eng.add_request(p, params(i)) for i, p in enumerate(PROMPTS)]
    final = run_to_completion(eng)
    return [final[r.request_id].token_ids for r in reqs]


async def trial(ctrl, t: int, rng: random.Random, expected) -> dict:
    streamed = [[] for _ in PROMPTS]
    errors = []
    total = sum(LENGTHS)
    trigger = rng.randint(1, int(total * 0.8))
    hit = asyncio.Event()
    count = 0

    async def one(i):
        nonlocal count
        async for out in ctrl.generate(PROMPTS[i], params(i), f"t{t}-r{i}"):
            streamed[i] += out.new_token_ids
            count += len(out.new_token_ids)
            if count >= trigger:
                hit.set()
            if out.finished and out.finish_reason != "length":
                errors.append(out.error or out.finish_reason)

    before = (ctrl.recovery.recoveries, ctrl.recovery.resumed, ctrl.recovery.recomputed_tokens, ctrl.recovery.lost_tokens, ctrl.recovery.recovery_seconds)
    tasks = [asyncio.ensure_future(one(i)) for i in range(len(PROMPTS))]
    await asyncio.wait_for(hit.wait(), 300)
    victim = rng.choice(sorted(ctrl.stages))
    proc = ctrl.stages[victim].process
    os.kill(proc.pid, signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*tasks), 600)
    while ctrl.recovery.recoveries == before[0]:  # the request may finish before the loss is noticed: wait for it
        await asyncio.sleep(0.01)
    after = (ctrl.recovery.recoveries, ctrl.recovery.resumed, ctrl.recovery.recomputed_tokens, ctrl.recovery.lost_tokens, ctrl.recovery.recovery_seconds)
    d = [a - b for a, b in zip(after, before)]
    ok = streamed == expected and not errors
    return {"trial": t, "victim": victim, "after_tokens": trigger, "ok": ok, "errors": errors,
            "mismatched": [i for i, (s, e) in enumerate(zip(streamed, expected)) if s != e],
            "recoveries": d[0], "resumed": d[1], "recomputed_tokens": d[2], "lost_tokens": d[3], "recovery_s": d[4]}


async def run(args, dtype: str) -> dict:
    from conftest import save_tiny_checkpoint, tiny_config

    from kvflow.config import ClusterConfig, EngineConfig
    from kvflow.controller.controller import Controller

    mc = tiny_config(num_layers=4)
    expected = reference(mc, dtype)
    rng = random.Random(args.seed)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_tiny_checkpoint(Path(tmp), mc)
        names = [n for n in LAYOUTS if n in args.layouts.split(",")]
        per = [args.trials // len(names) + (i < args.trials % len(names)) for i in range(len(names))]
        for name, n in zip(names, per):
            cfg = ClusterConfig(engine=EngineConfig(model=str(ckpt), dtype=dtype, num_kv_blocks=256, block_size=4,
                                                    deterministic=True), microbatch_size=4,
                                prompt_microbatch_size=2, heartbeat_timeout_s=30.0, replication=args.replication,
                                **LAYOUTS[name])
            ctrl = Controller(cfg)
            await ctrl.start()
            rows = []
            try:
                for t in range(n):
                    r = await trial(ctrl, t, rng, expected)
                    rows.append(r)
                    print(f"{dtype} {name} trial {t + 1}/{n}: kill {r['victim']} after {r['after_tokens']} tokens -> "
                          f"{'ok' if r['ok'] else 'FAILED ' + str(r['mismatched']) + str(r['errors'])} "
                          f"(resumed {r['resumed']}, recomputed {r['recomputed_tokens']}/{r['lost_tokens']} tokens, "
                          f"{r['recovery_s']:.2f}s)", flush=True)
            finally:
                await ctrl.shutdown()
            out[name] = rows
    return out


def default_dtypes() -> str:
    """bfloat16 (the dtype `auto` resolves to) and float32 where the CPU has native bf16, else float32."""
    from kvflow.config import resolve_dtype

    return "bfloat16,float32" if resolve_dtype("auto")[0] == "bfloat16" else "float32"


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=100, help="trials per dtype, spread over the layouts")
    ap.add_argument("--dtypes", default=None, help="comma-separated (default: bfloat16,float32 where the CPU has bf16, else float32)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated cluster layouts the trials are spread over")
    ap.add_argument("--replication", default="ring", choices=["ring", "none"],
                    help="ring: a replaced worker resumes from its replica's KV; none: its requests are recomputed")
    ap.add_argument("--seed", type=int, default=0, help="seed of the victims, kill moments and sampled requests")
    args = ap.parse_args()
    args.dtypes = args.dtypes or default_dtypes()
    t0 = time.time()
    res = {dtype: asyncio.run(run(args, dtype)) for dtype in args.dtypes.split(",")}
    print(f"\n{args.trials} trials per dtype in {time.time() - t0:.0f}s, replication {args.replication}")
    print(f"{'dtype':<10}{'layout':<13}{'trials':>7}{'passed':>8}{'resumed req':>13}{'recomputed/lost tok':>21}{'recovery p50 (s)':>18}")
    summary: dict[str, dict] = {}
    for dtype, layouts in res.items():
        summary[dtype] = {}
        for name, rows in layouts.items():
            s = {"trials": len(rows), "passed": sum(r["ok"] for r in rows), "resumed": sum(r["resumed"] for r in rows),
                 "recomputed_tokens": sum(r["recomputed_tokens"] for r in rows),
                 "lost_tokens": sum(r["lost_tokens"] for r in rows),
                 "recovery_p50_s": statistics.median(r["recovery_s"] for r in rows) if rows else 0.0}
            summary[dtype][name] = s
            print(f"{dtype:<10}{name:<13}{s['trials']:>7}{s['passed']:>8}{s['resumed']:>13}"
                  f"{s['recomputed_tokens']:>12}/{s['lost_tokens']:<8}{s['recovery_p50_s']:>18.2f}")
        total = sum(s["trials"] for s in summary[dtype].values())
        print(f"{dtype:<10}{'all':<13}{total:>7}{sum(s['passed'] for s in summary[dtype].values()):>8}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "chaos.json").write_text(json.dumps({"config": vars(args), "summary": summary, "trials": res}, indent=2))
    plot(summary, RESULTS / "chaos.png")
    print(f"wrote {RESULTS / 'chaos.json'} and chaos.png")


def plot(summary: dict, path: Path) -> None:
    from kvflow.plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(summary)
    for d, (dtype, layouts) in enumerate(summary.items()):
        names = list(layouts)
        xs = [i + d * width for i in range(len(names))]
        ax[0].bar(xs, [layouts[n]["trials"] for n in names], width, color="#ccc", label="trials" if d == 0 else None)
        ax[0].bar(xs, [layouts[n]["passed"] for n in names], width * 0.6, label=f"passed ({dtype})")
        ax[1].bar(xs, [layouts[n]["recovery_p50_s"] for n in names], width, label=dtype)
        for a in ax:
            a.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax[0].set_title("chaos trials (SIGKILL of a random worker)")
    ax[0].legend()
    ax[1].set_ylabel("recovery time p50 (s)")
    ax[1].legend()
    for a in ax:
        a.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
