"""`kvflow serve` (the OpenAI-compatible server) and `kvflow bench serve` (the open-loop load generator)."""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from pathlib import Path

from kvflow.cli.args import existing_path, float_list, length_dist, model_arg, number

DISTRIBUTED_FLAGS = ("prompt_depth", "token_depth", "depth", "prompt_microbatch", "token_microbatch")


def register(sub) -> None:
    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API (default 127.0.0.1:8000)",
                       usage="%(prog)s [options]  (grouped below)",
                       description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health, /metrics; docs/api.md).")
    m = s.add_argument_group("model")
    m.add_argument("--model", type=model_arg, default=None,
                   help="GGUF file or HF-style checkpoint dir (default: the embedded SmolLM2-135M-Instruct)")
    m.add_argument("--served-model-name", default=None, help="the model id clients send (default: the checkpoint's name)")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): bfloat16 where the CPU has native bf16 (AVX512-BF16/AMX), else float32")
    m.add_argument("--device", default="cpu", help="torch device the model runs on (the CPU kernels need cpu)")
    m.add_argument("--threads", type=number(int, 1), default=None,
                   help="torch CPU threads (default: torch's choice; pipeline modes: per worker, default 1)")
    m.add_argument("--max-model-len", type=number(int, 1), default=None, help="context length (default: the checkpoint's)")
    m.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                   help="batch-invariant kernels: a request's tokens do not depend on the other requests in its steps, "
                        "so greedy and seeded text survives batching and recovery in bf16 too (off: the "
                        "fastest kernel per batch shape)")

    h = s.add_argument_group("HTTP server")
    h.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    h.add_argument("--port", type=number(int, 0, 65535), default=8000, help="port to listen on (0: one the OS picks)")
    h.add_argument("--api-key", type=_api_key, default=None,
                   help="require 'Authorization: Bearer KEY' on every route but --open-paths (default: $KVFLOW_API_KEY; unset: no auth)")
    h.add_argument("--open-paths", default="/health,/metrics",
                   help="comma-separated paths answered without the API key ('' = none)")
    h.add_argument("--drain-timeout", type=number(float, 0), default=30.0,
                   help="on SIGTERM: seconds in-flight requests may still run before they are cancelled "
                        "(a second SIGTERM or Ctrl-C cancels them at once)")
    h.add_argument("--max-body-bytes", type=parse_bytes, default=None, metavar="SIZE",
                   help="refuse request bodies larger than SIZE with 413, before parsing them (default: 32 bytes per "
                        "context token, at least 1M)")
    h.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="of the HTTP server's and kvflow's own log lines (stderr)")

    sc = s.add_argument_group("scheduling")
    sc.add_argument("--max-num-seqs", type=number(int, 1), default=64, help="most requests running at once")
    sc.add_argument("--max-num-batched-tokens", type=number(int, 1), default=None,
                    help="token budget of one step: decodes first, then prompt chunks (default: prefill chunk size + "
                         "max-num-seqs, 2112)")
    sc.add_argument("--prefill-chunk-size", type=number(int, 1), default=None,
                    help="most prompt tokens of one request per step (default: SchedulerConfig's, 2048)")
    sc.add_argument("--reserve-kv", action=argparse.BooleanOptionalAction, default=True,
                    help="admit a request only while every running request's prompt + max_tokens fits in the KV cache, "
                         "so none is ever preempted (--no-reserve-kv: admit greedily, preempt when full)")
    sc.add_argument("--policy", default="continuous", choices=["continuous", "microbatch"],
                    help="pipeline modes: continuous batching with chunked prefill, or DejaVu's microbatch baseline")

    kv = s.add_argument_group("KV cache")
    kv.add_argument("--kv-cache-gb", type=number(float, 0, low_open=True), default=1.0,
                    help="memory for the KV cache (pipeline modes: per stage), GB")
    kv.add_argument("--gpu-memory-utilization", type=number(float, 0, 1, low_open=True), default=None, metavar="FRACTION",
                    help="on CUDA, instead of --kv-cache-gb: size the KV cache to what is left of this fraction of the "
                         "GPU's memory after the weights and one full step (as vLLM). Engine mode: its cache; pipeline "
                         "modes: every stage measures over its layers, stages sharing a GPU share the fraction, and each "
                         "pipeline's pool is the fewest blocks any of its stages has room for, cut where the replicas would not "
                         "fit in /dev/shm (default: none)")
    kv.add_argument("--block-size", type=number(int, 1), default=None,
                    help="tokens per KV block (default: 128 on CPU, where bigger blocks read KV faster; 16 on CUDA)")
    kv.add_argument("--prefix-caching", "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    dest="enable_prefix_caching",
                    help="keep full KV blocks after a request and reuse them for prompts that start the same way "
                         "(--no-prefix-caching turns it off)")
    kv.add_argument("--host-kv-bytes", type=parse_bytes, default=0, metavar="SIZE",
                    help="prefix cache: keep KV blocks evicted from the device cache in host memory, up to SIZE "
                         "(bytes, or with a K/M/G/T suffix; all layers counted; default 0: off)")
    kv.add_argument("--disk-kv-bytes", type=parse_bytes, default=0, metavar="SIZE",
                    help="prefix cache: below the host tier, keep blocks in checksummed chunk files, up to SIZE "
                         "(needs --host-kv-bytes; default 0: off)")
    kv.add_argument("--disk-kv-path", default=None,
                    help="directory of the disk tier (default: a fresh temporary directory; files left by an earlier run are deleted)")

    p = s.add_argument_group("pipeline modes", "worker processes: a colocated pipeline (the DejaVu baseline) or a "
                                               "prompt pipeline streaming KV into a token pipeline")
    p.add_argument("--mode", default="engine", choices=["engine", "colocated", "disaggregated"],
                   help="engine: one process; colocated: one pipeline of --depth worker processes doing prompts and "
                        "tokens; disaggregated: a prompt pipeline streaming KV into a token pipeline")
    p.add_argument("--depth", type=number(int, 1), default=None, help="colocated pipeline depth (default 2)")
    p.add_argument("--prompt-depth", type=number(int, 1), default=None, help="disaggregated: prompt pipeline depth (default 1)")
    p.add_argument("--token-depth", type=number(int, 1), default=None, help="disaggregated: token pipeline depth (default 1)")
    p.add_argument("--prompt-microbatch", type=number(int, 1), default=None,
                   help="disaggregated: prompt microbatch size (default 4)")
    p.add_argument("--token-microbatch", type=number(int, 1), default=None,
                   help="colocated and token microbatch size (default: --max-num-seqs over the pipeline's depth)")
    p.add_argument("--swapping", action="store_true",
                   help="colocated and token pipelines: keep the KV of batches not computing on a stage in host "
                        "memory, swapped in while the previous one computes (DejaVu microbatch swapping); --kv-cache-gb "
                        "is then each stage's device budget, and the pipeline holds depth/min(2, depth) times more KV")
    p.add_argument("--decode-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="token (and colocated) pipelines of at most --decode-ahead-depth stages compute the next greedy "
                        "decode step while the controller applies the previous one; the engine mode on CUDA launches "
                        "the next greedy decode step before reading the previous one's tokens back "
                        "(--no-decode-ahead: one step at a time)")
    p.add_argument("--decode-ahead-depth", type=int, default=1,
                   help="the deepest pipeline that decodes ahead (default 1: deeper ones have not been measured faster)")
    p.add_argument("--internal-host", default=None,
                   help="interface the controller and workers bind for their internal sockets "
                        "(default 127.0.0.1, whatever --host the HTTP server uses)")
    p.add_argument("--external-workers", action="store_true",
                   help="do not spawn workers: print the `kvflow worker` commands to start (e.g. on other hosts) and wait")

    f = s.add_argument_group("fault tolerance (pipeline modes)")
    f.add_argument("--recovery", default="recompute", choices=["recompute", "none"],
                   help="on a worker's death or hang, replace it and bring its requests back (recompute), "
                        "or fail them (none: fail-stop)")
    f.add_argument("--replication", default="ring", choices=["ring", "store", "none"],
                   help="colocated and token stages stream the KV each step appends to a replica, so a "
                        "replaced stage resumes from it instead of recomputing: ring = the next stage of the pipeline "
                        "(depth 1: the controller's host store), store = the controller's host store")
    f.add_argument("--heartbeat-timeout", type=number(float, 0, low_open=True), default=3.0,
                   help="seconds without a heartbeat after which a worker is fenced and replaced")
    f.add_argument("--max-restarts", type=number(int, 0), default=3,
                   help="failed replacements in a row after which the server exits with code 1")

    r = s.add_argument_group("Ray launcher (pipeline modes; docs/deploy.md)")
    r.add_argument("--launcher", default="subprocess", choices=["subprocess", "ray"],
                   help="who starts the workers: child processes of this one, or Ray actors placed on a Ray "
                        "cluster by a placement group (needs `pip install kvflow[ray]`)")
    r.add_argument("--ray-address", default=None,
                   help="--launcher ray: the cluster to join: auto (one running on this machine) or HOST:PORT "
                        "(default: $RAY_ADDRESS, else a running local cluster, else a new local one)")
    r.add_argument("--placement-strategy", default=None, choices=["PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK"],
                   help="--launcher ray: how the placement group spreads the stages over nodes (default: the --plan "
                        "file's, else PACK)")
    r.add_argument("--plan", type=Path, default=None,
                   help="--launcher ray: JSON placement, which stage on which Ray node (format: "
                        "kvflow/controller/ray_launcher.py, docs/deploy.md; default: none)")
    s.set_defaults(func=run_serve)

    b = sub.add_parser("bench", help="benchmarks against a running server (start `kvflow serve` first)")
    bsub = b.add_subparsers(dest="bench_command", metavar="BENCH")
    bs = bsub.add_parser("serve", help="open-loop load generator against a running server: Poisson arrivals, rate sweep, "
                                       "TTFT/TPOT/normalized latency",
                         description="Open-loop load generator. Start the server first (kvflow serve, or any "
                                     "OpenAI-compatible server such as vLLM) and point --url at it.")
    bs.add_argument("--url", type=_local_url, default="http://127.0.0.1:8000",
                    help="base URL of the running server (127.0.0.1/localhost only)")
    bs.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    bs.add_argument("--tokenizer", default=None,
                    help="local checkpoint whose vocabulary the synthetic prompts use when the server's /v1/models "
                         "does not list vocab_size, as vLLM's does not (default: the embedded SmolLM2)")
    bs.add_argument("--rates", type=float_list, default="1", help="comma-separated request rates in req/s, e.g. 0.5,1,2")
    bs.add_argument("--num-requests", type=number(int, 1), default=100, help="requests per rate")
    bs.add_argument("--max-duration", type=number(float, 0, low_open=True), default=600.0, help="seconds per rate before the run is cut off")
    bs.add_argument("--prompt-len", type=number(int, 1), default=256, help="synthetic prompt length in tokens")
    bs.add_argument("--output-dist", type=length_dist, default=None,
                    help="output lengths: lmsys, constant:N or lognormal:MEDIAN:P90 (default: lmsys for synthetic "
                         "prompts, the trace's with --trace)")
    bs.add_argument("--output-scale", type=number(float, 0, low_open=True), default=1.0, help="multiply sampled output lengths")
    bs.add_argument("--max-output-len", type=number(int, 1), default=None, help="cap output lengths (default: no cap)")
    bs.add_argument("--trace", type=existing_path, default=None,
                    help="Azure trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens) instead of synthetic prompts (default: none)")
    bs.add_argument("--length-scale", type=number(float, 0, low_open=True), default=1.0, help="multiply trace prompt lengths")
    bs.add_argument("--trace-arrivals", action="store_true", help="replay the trace's timing, stretched to each rate")
    bs.add_argument("--seed", type=int, default=0, help="seed of the arrivals and lengths")
    bs.add_argument("--temperature", type=number(float, 0, high=100), default=0.0,
                    help="sampling temperature sent with every request (0: greedy; vLLM's `bench serve` sends none, "
                         "which servers read as 1.0)")
    bs.add_argument("--ttft-slo", type=number(float, 0, low_open=True), default=None,
                    help="seconds; goodput counts requests meeting it (default: no SLO)")
    bs.add_argument("--tpot-slo", type=number(float, 0, low_open=True), default=None,
                    help="seconds per output token (default: no SLO)")
    bs.add_argument("--latency-bound", type=number(float, 0, low_open=True), default=None,
                    help="s/token: report the highest rate whose median normalized latency stays below (default: not reported)")
    bs.add_argument("--label", default="kvflow", help="name of this configuration in the JSON and plot")
    bs.add_argument("--out", type=Path, default=Path("results/bench_serve"), help="output path prefix (.json and .png)")
    bs.add_argument("--compare", type=existing_path, action="append", default=[],
                    help="earlier JSON output to draw on the same plot (repeatable; default: none)")
    bs.add_argument("--no-progress", action="store_true", help="no progress bar per rate")
    bs.set_defaults(func=run_bench_serve)
    b.set_defaults(func=lambda args: (b.print_help(), 2)[1])


def _check_mode(args) -> None:
    given = [f"--{f.replace('_', '-')}" for f in DISTRIBUTED_FLAGS if getattr(args, f) is not None]
    if args.mode == "engine" and (given or args.external_workers):
        raise ValueError(f"{', '.join(given) or '--external-workers'} need --mode colocated or disaggregated")
    if args.mode == "colocated" and any(getattr(args, f) is not None for f in ("prompt_depth", "token_depth", "prompt_microbatch")):
        raise ValueError("--prompt-depth/--token-depth/--prompt-microbatch are for --mode disaggregated; use --depth")
    if args.mode == "disaggregated" and args.depth is not None:
        raise ValueError("--depth is for --mode colocated; use --prompt-depth and --token-depth")
    ray_flags = [f for f, v in (("--ray-address", args.ray_address), ("--placement-strategy", args.placement_strategy),
                                ("--plan", args.plan)) if v is not None]
    if args.launcher != "ray" and ray_flags:
        raise ValueError(f"{', '.join(ray_flags)} need --launcher ray")
    if args.launcher == "ray" and args.mode == "engine":
        raise ValueError("--launcher ray needs --mode colocated or disaggregated")
    if args.launcher == "ray" and args.external_workers:
        raise ValueError("--launcher ray and --external-workers exclude each other")
    if args.gpu_memory_utilization is not None and not args.device.startswith("cuda"):
        raise ValueError("--gpu-memory-utilization needs --device cuda (on CPU, give --kv-cache-gb)")
    if args.plan is not None and not args.plan.is_file():
        raise ValueError(f"--plan {str(args.plan)!r}: no such file")


def _scheduler_config(args):
    from kvflow.sched.config import SchedulerConfig

    given = {k: getattr(args, k) for k in ("max_num_batched_tokens", "prefill_chunk_size") if getattr(args, k) is not None}
    return SchedulerConfig(max_num_seqs=args.max_num_seqs, reserve_kv=args.reserve_kv, **given)


def _engine_config(args):
    """The EngineConfig of `kvflow serve` in every mode: blocks of --block-size tokens (default
    `default_block_size`); the pipeline modes account KV in blocks, so --kv-cache-gb becomes an
    explicit number of blocks there (with --gpu-memory-utilization the stages measure them at start-up)."""
    import dataclasses

    from kvflow.config import EngineConfig, default_block_size
    from kvflow.kv.cache import KVLayout
    from kvflow.model.loader import load_config

    block_size = default_block_size(args.device) if args.block_size is None else args.block_size
    engine = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=block_size,
                          max_model_len=args.max_model_len, kv_cache_memory_gb=args.kv_cache_gb,
                          enable_prefix_caching=args.enable_prefix_caching, deterministic=args.deterministic,
                          host_kv_bytes=args.host_kv_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
                          disk_kv_bytes=args.disk_kv_bytes, disk_kv_path=args.disk_kv_path,
                          scheduler=_scheduler_config(args))
    if args.mode == "engine":
        return dataclasses.replace(engine, num_threads=args.threads, decode_ahead=args.decode_ahead)
    if engine.gpu_memory_utilization is not None:  # the stages measure the blocks at start-up
        return engine
    mc, _ = load_config(args.model)
    per_block = KVLayout.for_model(mc, 1, engine.block_size, dtype=engine.torch_dtype).bytes_per_block
    return dataclasses.replace(engine, num_kv_blocks=engine.kv_blocks(per_block))


def _controller(args):
    from kvflow.config import ClusterConfig
    from kvflow.controller.controller import Controller
    from kvflow.controller.launcher import ExternalLauncher, SubprocessLauncher, local_gpus

    engine = _engine_config(args)
    ray_cfg = None
    if args.launcher == "ray":
        from kvflow.controller.ray_launcher import Placement, RayConfig, connect

        ray_cfg = RayConfig(args.ray_address, args.placement_strategy, Placement.load(args.plan) if args.plan else Placement())
        # the controller binds where the workers on other nodes reach it: this node's IP
        args.internal_host = args.internal_host or connect(args.ray_address)
    kw = dict(engine=engine, mode=args.mode, threads_per_worker=args.threads or 1, host=args.internal_host or "127.0.0.1",
              policy=args.policy, recovery=args.recovery, replication=args.replication,
              heartbeat_timeout_s=args.heartbeat_timeout, max_restarts=args.max_restarts, swapping=args.swapping,
              decode_ahead=args.decode_ahead, decode_ahead_depth=args.decode_ahead_depth)
    if args.mode == "colocated":
        kw["depth"] = args.depth or 2
    else:
        kw["prompt_depth"] = args.prompt_depth or 1
        kw["token_depth"] = args.token_depth or 1
        kw["prompt_microbatch_size"] = args.prompt_microbatch or 4
    kw["microbatch_size"] = args.token_microbatch  # (None: --max-num-seqs over the pipeline's batches in flight)
    cluster = ClusterConfig(**kw)
    if ray_cfg is not None:
        from kvflow.controller.ray_launcher import RayLauncher

        launcher = RayLauncher(cluster, ray_cfg)
        print(f"[kvflow] Ray placement group ({launcher.strategy}): {dict(zip(launcher.names, launcher.bundles))}",
              file=sys.stderr)
    else:
        launcher = ExternalLauncher() if args.external_workers else SubprocessLauncher(local_gpus(args.device))
    ctrl = Controller(cluster, args.served_model_name, launcher)
    if args.external_workers:
        print(f"[kvflow] controller at {ctrl.address}; start these workers (same model file on each host; they "
              f"receive every other setting from the controller):", file=sys.stderr)
    return ctrl


def _local_url(text: str) -> str:
    """An argparse type: a URL on this machine (`kvflow.bench.client.check_local`'s rule, checked here
    too because importing the load generator takes seconds)."""
    from urllib.parse import urlsplit

    try:
        host = urlsplit(text).hostname
    except ValueError:
        host = None
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise argparse.ArgumentTypeError(f"kvflow bench serve only targets 127.0.0.1/localhost, not {host or text!r}")
    return text


def _api_key(text: str) -> str:
    """An argparse type: a non-empty API key without surrounding whitespace."""
    if not text or text != text.strip():
        raise argparse.ArgumentTypeError("the API key must be non-empty, without surrounding whitespace")
    return text


def _api_config(args):
    from kvflow.api.server import APIConfig

    key = args.api_key if args.api_key is not None else (os.environ.get("KVFLOW_API_KEY") or None)
    if key is not None and not key.strip():
        raise ValueError("--api-key must not be empty")
    open_paths = tuple(p.strip() for p in args.open_paths.split(",") if p.strip())
    return APIConfig(api_key=key, open_paths=open_paths, drain_timeout_s=args.drain_timeout,
                     max_body_bytes=args.max_body_bytes)


def _log_to_stderr(level: str) -> None:
    """kvflow's own log lines (worker starts, recoveries, model loading) at `--log-level`, beside uvicorn's."""
    import logging

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)-9s [%(name)s] %(message)s"))
    root = logging.getLogger("kvflow")
    root.setLevel(level.upper())
    root.addHandler(handler)


def _listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before anything slow happens: a port in use fails in a fraction
    of a second instead of after the model loaded. It listens only once the server has started, so
    until then a client's connection is refused rather than left waiting."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait out TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = " (another server is listening there; pick another --port)" if e.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock


def run_serve(args) -> int:
    _check_mode(args)
    if args.mode == "engine" and args.swapping:
        raise ValueError("--swapping is for pipeline modes (--mode colocated or disaggregated)")
    sock = _listen_socket(args.host, args.port)  # before any heavy import or model load
    _log_to_stderr(args.log_level)
    from kvflow.api.server import serve

    api_config = _api_config(args)  # checked before the model loads
    from kvflow.config import resolve_dtype

    args.dtype, why = resolve_dtype(args.dtype, args.device)  # once, here: every worker gets the same
    print(f"[kvflow] dtype {args.dtype} ({why})", file=sys.stderr)
    what = "the engine" if args.mode == "engine" else "the controller and its worker processes"
    print(f"[kvflow] loading {args.model or 'the default model'} and starting {what}; the address follows once "
          f"the server listens", file=sys.stderr, flush=True)
    if args.mode == "engine":
        from kvflow.serving.backend import EngineBackend

        config = _engine_config(args)
        # the engine built on its own thread
        backend = EngineBackend.from_config(config, args.served_model_name, api_config.api_key)
    else:
        backend = _controller(args)
    port = sock.getsockname()[1]
    url = f"http://[{args.host}]:{port}/v1" if ":" in args.host else f"http://{args.host}:{port}/v1"

    def listening() -> None:  # the model is loaded (workers started) and the socket accepts connections
        print(f"[kvflow] serving {backend.model_name!r} ({args.mode}, context {backend.max_model_len}) on {url}",
              file=sys.stderr, flush=True)

    try:
        return serve(backend, args.host, port, args.log_level, api_config, sock=sock, on_listening=listening)
    finally:
        sock.close()
        if args.mode != "engine":
            backend.workers.launcher.close()  # after the workers stopped (the Ray launcher's placement group)


def _length_dist(spec: str | None):
    from kvflow.simulator.workload import LengthDist

    if spec is None:
        return None
    kind, *vals = spec.split(":")
    try:
        if kind == "lmsys" and not vals:
            return LengthDist("lmsys")
        if kind == "constant" and len(vals) == 1:
            return LengthDist("constant", value=int(vals[0]), max_len=max(int(vals[0]), 1))
        if kind == "lognormal" and len(vals) == 2:
            return LengthDist("lognormal", median=float(vals[0]), p90=float(vals[1]))
    except ValueError as e:
        raise ValueError(f"--output-dist {spec!r}: {e}") from e
    raise ValueError(f"--output-dist must be lmsys, constant:N or lognormal:MEDIAN:P90, got {spec!r}")


def run_bench_serve(args) -> int:
    from kvflow.bench.dataset import DatasetSpec
    from kvflow.bench.report import max_sustained_rate, save, table
    from kvflow.slo import SLO
    from kvflow.bench.runner import BenchConfig, run_sweep

    rates = args.rates  # parsed by `float_list`
    dataset = DatasetSpec(num_requests=args.num_requests, prompt_len=args.prompt_len, output=_length_dist(args.output_dist),
                          output_scale=args.output_scale, max_output_len=args.max_output_len, trace=args.trace,
                          length_scale=args.length_scale, trace_arrivals=args.trace_arrivals, seed=args.seed)
    cfg = BenchConfig(url=args.url, rates=rates, dataset=dataset, slo=SLO(args.ttft_slo, args.tpot_slo),
                      max_duration=args.max_duration, model=args.model, progress=not args.no_progress,
                      tokenizer=args.tokenizer, temperature=args.temperature)
    import asyncio

    summaries = asyncio.run(run_sweep(cfg))
    print(table(summaries))
    config = {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if k == "compare" else v)
              for k, v in vars(args).items() if k != "func"}
    jpath, ppath = save(summaries, config, args.out, args.latency_bound, tuple(args.compare))
    if args.latency_bound:
        best = max_sustained_rate(summaries, args.latency_bound)
        print(f"max rate with median normalized latency <= {args.latency_bound:g} s/token: {best if best is not None else 'none'}")
    print(f"wrote {jpath} and {ppath}")
    return 0


def parse_bytes(text: str) -> int:
    """A byte count: "1048576", "512M", "4G", "1.5GiB" (K/M/G/T are powers of 1024)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1
    if t and t[-1] in "KMGT":
        scale, t = 1024 ** ("KMGT".index(t[-1]) + 1), t[:-1]
    try:
        n = float(t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4G, 512M, 1048576)") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"a size cannot be negative: {text!r}")
    return int(n)
