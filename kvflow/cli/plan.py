"""`kvflow plan`, `kvflow simulate` and `kvflow profile`: the planner, the simulator and the
calibration of the profiled performance model from the real engine."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvflow.cli.args import existing_path, int_list, length_dist, model_arg, number


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="recommend a prompt/token machine split (DéjàVu planner)",
                       description="Recommend how to split a cluster between prompt and token pipelines (DéjàVu's "
                                   "planner, docs/planner.md). Layouts are written (2d, 4p, 16b): 2 replicas (d) of "
                                   "a pipeline of 4 stages (p) running microbatches of 16 requests (b); a "
                                   "disaggregated layout lists its prompt pipelines, then its token pipelines.")
    _hardware_args(p)
    p.add_argument("--machines", type=number(int, 1), required=True, help="cluster size D")
    p.add_argument("--goal", choices=["makespan", "goodput"], default="makespan",
                   help="makespan: DéjàVu's search (Appendix B/D); goodput: DistServe's Algorithm 1 for --rate")
    p.add_argument("--rate", type=number(float, 0, low_open=True),
                   help="--goal goodput: the traffic rate R to serve (requests/s; default: none, required there)")
    p.add_argument("--max-depth", type=number(int, 1), default=16, help="deepest pipeline considered (replicas beyond)")
    p.add_argument("--ttft-slo", type=number(float, 0, low_open=True),
                   help="seconds; with --tpot-slo also searches goodput (default: no SLO)")
    p.add_argument("--tpot-slo", type=number(float, 0, low_open=True),
                   help="seconds per output token (default: no SLO)")
    p.add_argument("--attainment", type=number(float, 0, 1, low_open=True), default=0.9,
                   help="share of requests that must meet both SLOs")
    p.add_argument("--trial-requests", type=number(int, 1), default=150,
                   help="--goal goodput: requests per simulated trial of the rate search")
    p.add_argument("--decode-microbatches", type=int_list, default=None,
                   help="--goal goodput: decode batch sizes (default: --microbatches)")
    p.add_argument("--json", type=Path, help="write the plan as JSON here (default: not written)")
    p.add_argument("--jobs", type=number(int, 1), default=None,
                   help="--goal makespan: worker processes simulating the candidates (default: one per CPU)")
    p.add_argument("--placement", type=Path, metavar="FILE",
                   help="--goal makespan: write a Ray placement of the best configuration `kvflow serve` runs "
                        "(one colocated pipeline, or one prompt + one token pipeline) for `kvflow serve --launcher ray "
                        "--plan FILE` (default: not written)")
    p.add_argument("--ray-nodes", default=None, metavar="IP,IP,...",
                   help="with --placement: the Ray nodes' IPs, one stage per node in order (default: none)")
    p.set_defaults(func=cmd_plan)

    s = sub.add_parser("simulate", help="simulate a scenario (YAML) or one layout given by flags")
    s.add_argument("--scenario", type=existing_path, help="YAML scenario: sweeps its machine counts (default: none; "
                                                          "then --layout)")
    _hardware_args(s)
    s.add_argument("--layout", type=layout_spec, help="'8p16b' (baseline), '4x2p16b' (DP) or '3p16b,5p16b' (prompt,token; "
                                    "replicas as '2x3p16b,4x5p16b'; default: none, then --scenario)")
    s.add_argument("--rate", type=number(float, 0, low_open=True),
                   help="Poisson requests/s (default: all arrive at t=0)")
    s.add_argument("--trace", type=existing_path, help="Azure LLM inference trace CSV (default: synthetic requests)")
    s.add_argument("--time-scale", type=number(float, 0, low_open=True), default=1.0,
                   help="multiply trace arrival times")
    s.add_argument("--fail", action="append", default=[], metavar="T[:ROLE[:PIPE[:STAGE]]]",
                   help="kill a worker at T seconds (role prompt|token; repeatable; default: none)")
    s.add_argument("--recovery", choices=["resume", "restart"], default="resume",
                   help="after a failure: resume from the replicated KV, or restart the lost requests")
    s.add_argument("--recovery-costs", type=existing_path, metavar="JSON",
                   help="measured recovery costs (results/fault_tolerance.json of benchmarks/fault_tolerance.py) "
                        "instead of the defaults (default: detect 1 s, restart 10 s, restore modelled from the KV size)")
    s.add_argument("--dispatch", choices=["shared", "round_robin"], default="shared",
                   help="how requests reach replicas: one shared queue, or round robin")
    s.add_argument("--rigid-rounds", action="store_true", help="original FasterTransformer scheduling")
    s.add_argument("--ttft-slo", type=number(float, 0, low_open=True), help="seconds (default: no SLO)")
    s.add_argument("--tpot-slo", type=number(float, 0, low_open=True), help="seconds per output token (default: no SLO)")
    s.add_argument("--out", type=Path, default=Path("results/simulate"), help="output stem for .json/.png")
    s.set_defaults(func=cmd_simulate)

    f = sub.add_parser("profile", help="time the real engine and write a profile for ProfiledPerfModel")
    f.add_argument("--out", type=Path, default=Path("results/profile.json"), help="the profile's JSON file")
    f.add_argument("--model", type=model_arg, default=None,
                   help="checkpoint path (default: the embedded SmolLM2-135M)")
    f.add_argument("--batches", type=int_list, default="1,2,4,8", help="decode batch sizes timed")
    f.add_argument("--prompt-lens", type=int_list, default="16,64,128,256", help="prompt lengths timed")
    f.add_argument("--contexts", type=int_list, default="32,128,512", help="decode context lengths timed")
    f.add_argument("--repeats", type=number(int, 1), default=3,
                   help="passes over the grid, each in a shuffled order (a prefill time is its shape's median over "
                        "the passes; each pass adds 2 decode steps per batch and context)")
    f.add_argument("--threads", type=number(int, 1), default=1, help="torch CPU threads")
    f.set_defaults(func=cmd_profile)


def _hardware_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="opt-66b", help="model shape name (see kvflow.perf.MODELS)")
    p.add_argument("--machine", default="2xA100-80GB", help="NxDEVICE: A100-80GB, V100-16GB, H100-80GB, CPU")
    p.add_argument("--link-gbps", type=number(float, 0, low_open=True), default=100.0,
                   help="network bandwidth between machines, Gbit/s")
    p.add_argument("--cost-per-hour", type=number(float, 0), default=1.0, help="price of one machine per hour")
    p.add_argument("--profile", type=existing_path,
                   help="use a measured profile (kvflow profile) instead of the analytic model (default: analytic)")
    p.add_argument("--prompt-len", type=number(int, 1), default=1000, help="prompt tokens per request")
    p.add_argument("--output", type=length_dist, default="lmsys",
                   help="output lengths: 'lmsys', 'constant:N' or 'lognormal:MEDIAN:P90'")
    p.add_argument("--max-output", type=number(int, 1), default=1024, help="cap on output lengths")
    p.add_argument("--microbatches", type=int_list, default="2,4,8,16,32", help="microbatch sizes considered")
    p.add_argument("--requests", type=number(int, 1), default=2048, help="requests in the simulated workload")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated workload")
    p.add_argument("--swapping", action="store_true", help="token pipelines swap KV to host memory (DéjàVu)")


def _perf(args):
    from kvflow.perf.hardware import machine
    from kvflow.perf.model_shape import model_shape

    if not args.profile:  # an unknown --model or --machine fails before numpy is imported
        shape, hw = model_shape(args.model), machine(args.machine, args.link_gbps, args.cost_per_hour)
    from kvflow.perf import AnalyticPerfModel, ProfiledPerfModel
    from kvflow.perf.profiled import Profile

    if args.profile:
        return ProfiledPerfModel(Profile.load(args.profile))
    return AnalyticPerfModel(shape, hw)


def _workload_spec(args):
    from kvflow.simulator.scenario import WorkloadSpec
    from kvflow.simulator.workload import LengthDist

    kind, *vals = args.output.split(":")
    if kind == "constant" and len(vals) == 1:
        dist = LengthDist("constant", value=int(vals[0]), max_len=args.max_output)
    elif kind == "lognormal" and len(vals) == 2:
        dist = LengthDist("lognormal", median=float(vals[0]), p90=float(vals[1]), max_len=args.max_output)
    elif kind == "lmsys" and not vals:
        dist = LengthDist("lmsys", max_len=args.max_output)
    else:
        raise ValueError(f"--output {args.output!r}: use lmsys, constant:N or lognormal:MEDIAN:P90")
    return WorkloadSpec(args.requests, args.prompt_len, dist, getattr(args, "rate", None), True, args.seed,
                        str(args.trace) if getattr(args, "trace", None) else None,
                        time_scale=getattr(args, "time_scale", 1.0))


def _counting(fn: Callable, what: str) -> tuple[Callable, "object"]:
    """`fn` wrapped so that each call (one simulated layout or rate) advances a progress counter on
    stderr (a live bar on a terminal); returns (wrapped, the bar, to close)."""
    from tqdm import tqdm

    print(f"[kvflow] {what} (each simulation takes seconds to a minute)", file=sys.stderr, flush=True)
    bar = tqdm(desc=what, unit=" simulations", file=sys.stderr, disable=None, leave=False)

    def wrapped(*a, **kw):
        bar.update(1)
        return fn(*a, **kw)

    return wrapped, bar


def cmd_plan(args) -> int:
    if args.goal == "goodput":
        return _plan_goodput(args)
    if (args.ttft_slo is None) != (args.tpot_slo is None):  # bad arguments fail before the search
        raise ValueError("give both --ttft-slo and --tpot-slo")
    if args.placement and not args.ray_nodes:
        raise ValueError("--placement needs --ray-nodes (the Ray nodes' IPs, one stage per node)")
    perf = _perf(args)  # an unknown --model or --machine fails here, before the simulator is imported
    from kvflow.planner import SearchSpace, recommend
    from kvflow.planner.goodput import max_rate
    from kvflow.slo import SLO

    spec = _workload_spec(args)
    space = SearchSpace(spec.prompt_len, spec.max_tokens, spec.mean_output, args.microbatches,
                        args.swapping, replicate=True, max_depth=args.max_depth)
    # Enough requests to fill every pipeline slot several times over.
    n_req = max(spec.requests, 128 * args.machines)
    t0 = time.perf_counter()
    _, bar = _counting(lambda: None, f"simulating the shortlisted layouts ({n_req} requests each)")
    with bar:
        plan = recommend(perf, args.machines, space, lambda b: spec.build(b, requests=n_req), jobs=args.jobs,
                         progress=lambda e: bar.update(1))
    elapsed = time.perf_counter() - t0
    print(f"plan: {perf.shape.name} on {args.machines} x {perf.machine.name} "
          f"(prompt {spec.prompt_len}, mean output {spec.mean_output:.0f}, {plan.simulated} layouts simulated, "
          f"{elapsed:.2f} s)")
    for line in plan.reasons:
        print("  " + line)
    doc = {"machines": args.machines, "seconds": elapsed, "reasons": plan.reasons,
           "formulas": plan.formulas.__dict__,
           "best": {k: e.to_dict() for k, e in plan.best.items()}}
    if args.ttft_slo is not None:
        slo = SLO(args.ttft_slo, args.tpot_slo)
        doc["goodput"] = {}
        print("[kvflow] searching each kind's highest rate within the SLOs", file=sys.stderr, flush=True)
        for kind, e in sorted(plan.best.items()):
            guess = e.summary.throughput_rps
            g = max_rate(perf, e.layout, lambda r: spec.build(e.layout.prompt.microbatch, rate=r, requests=n_req),
                         slo, args.attainment, hi=guess, swapping=args.swapping)
            doc["goodput"][kind] = {"layout": e.layout.label(), "rate": g.rate, "per_machine": g.per_machine}
            print(f"  goodput {kind} {e.layout.label()}: {g.rate:.3f} req/s ({g.per_machine:.4f} per machine) at "
                  f"{g.attainment:.0%} SLO attainment ({g.simulations} simulations)")
        best = max(doc["goodput"].items(), key=lambda kv: kv[1]["per_machine"])
        doc["goodput_choice"] = best[0]
        print(f"  goodput-optimal placement: {best[0]} {best[1]['layout']} "
              f"({best[1]['per_machine']:.4f} req/s per machine at {args.attainment:.0%} attainment)")
        print(f"  total time {time.perf_counter() - t0:.2f} s")
    if args.placement:
        doc["placement"] = _write_placement(args, plan.best)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1, default=str))
    return 0


def _write_placement(args, best: dict) -> dict:
    """The Ray placement (which stage on which node) of the shortest-makespan configuration that one
    `kvflow serve` runs, and the serve command that takes it."""
    from kvflow.config import pipeline_specs
    from kvflow.controller.ray_launcher import Placement

    runnable = [e for e in best.values() if e.layout.prompt.count == 1 and (e.layout.token is None or e.layout.token.count == 1)]
    if not runnable:
        raise ValueError("no configuration of one pipeline per role was found; `kvflow serve` runs one of each")
    e = min(runnable, key=lambda e: e.summary.makespan_s)
    lay = e.layout
    if lay.token is None:
        specs = pipeline_specs("colocated", lay.prompt.depth, 0, 0, lay.prompt.microbatch, 0)
        flags = f"--mode colocated --depth {lay.prompt.depth} --token-microbatch {lay.prompt.microbatch}"
    else:
        specs = pipeline_specs("disaggregated", 0, lay.prompt.depth, lay.token.depth, lay.token.microbatch, lay.prompt.microbatch)
        flags = (f"--mode disaggregated --prompt-depth {lay.prompt.depth} --token-depth {lay.token.depth} "
                 f"--prompt-microbatch {lay.prompt.microbatch} --token-microbatch {lay.token.microbatch}")
    names = [sp.stage_name(i) for sp in specs for i in range(sp.depth)]
    placement = Placement.spread(names, [ip.strip() for ip in args.ray_nodes.split(",") if ip.strip()])
    args.placement.parent.mkdir(parents=True, exist_ok=True)
    args.placement.write_text(json.dumps(placement.to_dict(), indent=1))
    command = f"kvflow serve {flags} --launcher ray --ray-address auto --plan {args.placement}"
    print(f"  placement of {lay.kind} {lay.label()} -> {args.placement}; serve it with:\n    {command}")
    return {"layout": lay.label(), "kind": lay.kind, "file": str(args.placement), "command": command}


def _plan_goodput(args) -> int:
    """DistServe's Algorithm 1: prefill and decode instances chosen separately by simulated goodput
    per device, replicated to carry --rate; the best colocated instance alongside."""
    if args.rate is None or args.ttft_slo is None or args.tpot_slo is None:
        raise ValueError("--goal goodput needs --rate, --ttft-slo and --tpot-slo")
    perf = _perf(args)
    from kvflow.planner.placement import GoodputSpace, PlacementSearch
    from kvflow.slo import SLO

    spec = _workload_spec(args)
    space = GoodputSpace(max_depth=args.max_depth, microbatches=args.microbatches,
                         decode_microbatches=args.decode_microbatches)
    workload_at, bar = _counting(lambda r: spec.build(1, rate=r, requests=args.trial_requests),
                                 f"searching goodput per configuration ({args.trial_requests} requests per trial)")
    search = PlacementSearch(perf, workload_at, SLO(args.ttft_slo, args.tpot_slo), args.attainment, space)
    with bar:
        pl = search.place(args.rate, device_limit=args.machines * perf.machine.devices)
    print(f"goodput plan: {perf.shape.name} on up to {args.machines} x {perf.machine.name}, R = {args.rate} req/s, "
          f"TTFT <= {args.ttft_slo} s, TPOT <= {args.tpot_slo} s for {args.attainment:.0%} of requests "
          f"(prompt {spec.prompt_len}, mean output {spec.mean_output:.0f}; {pl.simulations} simulations, "
          f"{pl.seconds:.2f} s)")
    for name, g in (("prefill", pl.prefill), ("decode", pl.decode)):
        print(f"  {name:<8} {g.config.label():<20} goodput {g.rate:.3f} req/s per instance, "
              f"{g.per_device:.3f} per device")
    print(f"  placement: {pl.label()} = {pl.devices} devices; simulated at R: {pl.attainment:.0%} attainment; "
          f"{pl.per_device:.3f} req/s per device")
    for note in pl.notes:
        print("  note: " + note)
    if pl.colocated:
        c = pl.colocated
        print(f"  colocated {c.config.label():<20} goodput {c.rate:.3f} req/s per instance, {c.per_device:.3f} per "
              f"device -> {pl.colocated_devices} devices for R")
    doc = {"goal": "goodput", "rate": args.rate, "seconds": pl.seconds, "simulations": pl.simulations,
           "placement": pl.label(), "devices": pl.devices, "attainment": pl.attainment,
           "per_device": pl.per_device, "notes": pl.notes,
           "prefill": {"config": pl.prefill.config.label(), "instances": pl.prefill_instances,
                       "goodput": pl.prefill.rate, "per_device": pl.prefill.per_device},
           "decode": {"config": pl.decode.config.label(), "instances": pl.decode_instances,
                      "goodput": pl.decode.rate, "per_device": pl.decode.per_device},
           "colocated": None if pl.colocated is None else {
               "config": pl.colocated.config.label(), "goodput": pl.colocated.rate,
               "per_device": pl.colocated.per_device, "devices": pl.colocated_devices}}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


_LAYOUT = re.compile(r"^(?:(\d+)x)?(\d+)p(\d+)b$")


def layout_spec(text: str) -> str:
    """An argparse type: a layout as `parse_layout` reads it, checked without importing the simulator."""
    parts = text.split(",")
    bad = [p for p in parts if not _LAYOUT.match(p.strip())]
    if bad:
        raise argparse.ArgumentTypeError(f"layout part {bad[0]!r}: expected [COUNTx]DEPTHpBATCHb, e.g. 4x2p16b")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError("a layout has one colocated group or a prompt,token pair")
    return text


def parse_layout(text: str):
    from kvflow.simulator import Layout, PipelineGroup

    groups = []
    for part in text.split(","):
        m = _LAYOUT.match(part.strip())
        if not m:
            raise ValueError(f"layout part {part!r}: expected [COUNTx]DEPTHpBATCHb, e.g. 4x2p16b")
        groups.append(PipelineGroup(int(m[2]), int(m[3]), int(m[1] or 1)))
    if len(groups) > 2:
        raise ValueError("a layout has one colocated group or a prompt,token pair")
    return Layout(*groups)


def _recovery(args):
    from kvflow.simulator import Recovery

    if args.recovery_costs is None:
        return Recovery(args.recovery)
    costs = json.loads(args.recovery_costs.read_text()).get("recovery_costs")
    policy = {"resume": "resume", "restart": "recompute"}[args.recovery]  # the benchmark's policy names
    if not costs or policy not in costs:
        raise ValueError(f"{args.recovery_costs} has no measured recovery costs for {policy!r}")
    return Recovery.measured(args.recovery, costs[policy])


def cmd_simulate(args) -> int:
    if not args.scenario and not args.layout:  # before the simulator's (slow) import
        raise ValueError("give --scenario FILE or --layout")
    from kvflow.planner.report import mean_ratio, save, sweep, table
    from kvflow.simulator import Failure, SimConfig, simulate
    from kvflow.slo import SLO
    from kvflow.simulator.scenario import load_scenario

    if args.scenario:
        sc = load_scenario(args.scenario)
        from kvflow.perf import AnalyticPerfModel

        from tqdm import tqdm

        t0 = time.perf_counter()
        print(f"[kvflow] simulating {sc.name}: the best layout of each kind for {len(sc.machines)} cluster sizes",
              file=sys.stderr, flush=True)
        with tqdm(total=len(sc.machines), desc="[kvflow] cluster sizes", file=sys.stderr, disable=None,
                  leave=False) as bar:
            rows = sweep(sc, AnalyticPerfModel(sc.shape, sc.machine), progress=lambda row, s: bar.update(1))
        print(table(rows, sc.paper))
        ratios = {k: mean_ratio(rows, k) for k in ("baseline", "baseline-dp")}
        print(f"mean makespan ratio vs disaggregated: baseline {ratios['baseline']:.2f}x, "
              f"baseline-dp {ratios['baseline-dp']:.2f}x ({time.perf_counter() - t0:.1f} s)")
        js, png = save(rows, args.out if args.out != Path("results/simulate") else Path("results") / sc.name,
                       sc.name, {"ratios": ratios})
        print(f"wrote {js} and {png}")
        return 0
    perf, spec, layout = _perf(args), _workload_spec(args), parse_layout(args.layout)
    failures = []
    for f in args.fail:
        t, *rest = f.split(":")
        failures.append(Failure(float(t), rest[0] if rest else "prompt", *(int(x) for x in rest[1:3])))
    cfg = SimConfig(layout, args.dispatch, args.swapping, args.rigid_rounds, tuple(failures), _recovery(args))
    w = spec.build(layout.prompt.microbatch)
    t0 = time.perf_counter()
    res = simulate(cfg, perf, w)
    elapsed = time.perf_counter() - t0
    slo = SLO(args.ttft_slo, args.tpot_slo) if args.ttft_slo and args.tpot_slo else None
    s = res.summary(slo)
    for k, v in s.to_dict().items():
        print(f"  {k:<20} {v:.4g}" if isinstance(v, float) else f"  {k:<20} {v}")
    print(f"  {'simulated in':<20} {elapsed:.2f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"summary": s.to_dict(), "seconds": elapsed}, indent=1))
    print(f"wrote {args.out.with_suffix('.json')}")
    return 0


def cmd_profile(args) -> int:
    from kvflow.perf.calibrate import profile_engine

    shapes = len(args.batches) * (len(args.prompt_lens) + len(args.contexts))
    print(f"[kvflow] profiling the engine: {shapes} shapes x {args.repeats} passes (minutes; the model loads first)",
          file=sys.stderr, flush=True)
    prof = profile_engine(args.model, args.batches, args.prompt_lens, args.contexts, args.repeats, args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prof.save(args.out)
    from kvflow.perf import ProfiledPerfModel

    perf = ProfiledPerfModel(prof)
    print(f"wrote {args.out}: {len(prof.prompt)} prompt and {len(prof.token)} decode timings")
    print(f"  prompt fit {perf.prompt_fit.coef} (max rel. error {perf.prompt_fit.max_rel_error:.1%})")
    print(f"  token fit  {perf.token_fit.coef} (max rel. error {perf.token_fit.max_rel_error:.1%})")
    return 0
