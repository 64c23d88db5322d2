"""`kvflow router`: one OpenAI-compatible endpoint over several `kvflow serve` instances ([router.md](router.md))."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys


def register(sub) -> None:
    from kvflow.cli.args import existing_path, model_arg, number
    from kvflow.router.config import instance_url
    from kvflow.router.policies import POLICIES

    def url(text: str) -> str:
        try:
            return instance_url(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    r = sub.add_parser("router", help="route requests over several kvflow serve instances (one OpenAI endpoint)",
                       description="One OpenAI-compatible endpoint over several kvflow serve instances: placement "
                                   "by policy, health checks, failed instances' requests moved without losing a token.")
    r.add_argument("--instance", action="append", type=url, default=[], metavar="URL",
                   help="base URL of a kvflow serve instance, e.g. http://127.0.0.1:8001; repeat for each "
                        "(default: none besides --config's)")
    r.add_argument("--prefill", action="append", type=url, default=[], metavar="URL",
                   help="an instance of the prefill pool (P/D pools: prompts run there, the rest of each request on a "
                        "--decode instance, which pulls the prompt's KV; both engines with --host-kv-bytes); repeat "
                        "(default: none)")
    r.add_argument("--decode", action="append", type=url, default=[], metavar="URL",
                   help="an instance of the decode pool (see --prefill); repeat (default: none)")
    r.add_argument("--config", type=existing_path, default=None,
                   help="YAML or JSON file of router settings (instances, policy, placement, health checks); flags "
                        "given here override it, --instance adds to its instances (default: none)")
    r.add_argument("--launch", type=number(int, 0), default=None, metavar="N",
                   help="start N kvflow serve instances on this machine (free ports) and keep them running: one that "
                        "exits is started again (default: --config's, else 0)")
    r.add_argument("--launch-pd", default=None, metavar="P:D",
                   help="start P prefill and D decode instances on this machine (P/D pools, as --prefill and --decode; "
                        "kept running like --launch's; --host-kv-bytes 1G unless --serve-args sets it) (default: none)")
    r.add_argument("--launcher", default="local", choices=("local", "ray"),
                   help="where --launch / --launch-pd start the instances: processes of this machine, or processes "
                        "that Ray actors start on the nodes of a Ray cluster (extra kvflow[ray]; one CPU each)")
    r.add_argument("--ray-address", default=None,
                   help="--launcher ray: the cluster, as `ray.init`'s address (default: $RAY_ADDRESS, else a running "
                        "local cluster, else a new one)")
    r.add_argument("--serve-args", default=None, metavar="ARGS",
                   help="the launched instances' kvflow serve arguments, one string, e.g. \"--threads 1 --dtype float32\" "
                        "(--model is the router's --model unless given here; default: --config's, else none)")
    r.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="size the launched instances between MIN and MAX for the measured load: the fewest that meet "
                        "--ttft-slo/--tpot-slo in the simulated cluster (needs --launch and --scale-profile; default: off)")
    r.add_argument("--scale-profile", type=existing_path, default=None, metavar="FILE",
                   help="`kvflow profile` JSON of one instance as launched: the simulated instances' step times "
                        "(default: none; required by --autoscale)")
    r.add_argument("--rebalance", action="store_true",
                   help="move instances between the --prefill and --decode pools as the measured TTFT and TPOT "
                        "against --ttft-slo / --tpot-slo call for it, draining first (default: off)")
    r.add_argument("--ttft-slo", type=number(float, 0, low_open=True), default=2.0,
                   help="autoscaling and --rebalance: TTFT target, s")
    r.add_argument("--tpot-slo", type=number(float, 0, low_open=True), default=0.2,
                   help="autoscaling and --rebalance: time per output token target, s")
    r.add_argument("--scale-interval", type=number(float, 0, low_open=True), default=10.0,
                   help="autoscaling and --rebalance: seconds between decisions (autoscaling measures the load over the "
                        "last 60 s, --rebalance the requests of the last 30 s)")
    r.add_argument("--policy", default=None, choices=sorted(POLICIES),
                   help="placement policy (default: --config's, else prefix_aware)")
    r.add_argument("--model", type=model_arg, default=None,
                   help="the checkpoint the instances serve, for its tokenizer (default: the embedded SmolLM2-135M-Instruct)")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    r.add_argument("--port", type=number(int, 0, 65535), default=8000, help="port to listen on")
    r.add_argument("--wait", type=number(float, 0), default=120.0, help="seconds to wait for a first instance to answer")
    r.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but --open-paths (default: $KVFLOW_API_KEY; "
                        "unset: no auth)")
    r.add_argument("--open-paths", default="/health,/metrics", help="comma-separated paths answered without the key")
    r.add_argument("--drain-timeout", type=number(float, 0), default=30.0,
                   help="seconds in-flight requests may still run on shutdown")
    r.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="of the HTTP server's and kvflow's own log lines (stderr)")
    r.set_defaults(func=run_router)


def _flag(args: tuple[str, ...], name: str) -> str | None:
    """The value of `name` among command-line `args` ("--name value" or "--name=value"), None if not given."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def run_router(args) -> int:
    from kvflow.router.config import RouterConfig  # (the settings are checked before anything heavy is imported)

    scaling = None
    if args.autoscale is not None:
        from kvflow.router.config import ScalingConfig

        lo, sep, hi = args.autoscale.partition(":")
        if not (sep and lo.isdigit() and hi.isdigit()):
            raise ValueError(f"--autoscale is MIN:MAX, e.g. 1:4, got {args.autoscale!r}")
        if args.scale_profile is None:
            raise ValueError("--autoscale needs --scale-profile (a `kvflow profile` of one instance)")
        scaling = ScalingConfig(int(lo), int(hi), args.ttft_slo, args.tpot_slo, interval_s=args.scale_interval)
        from kvflow.perf.profiled import ProfiledPerfModel

        try:  # (read before any instance starts)
            perf = ProfiledPerfModel.from_json(args.scale_profile)
        except (OSError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"--scale-profile {args.scale_profile}: not a `kvflow profile` file ({type(e).__name__}: {e})") from None
        if args.launch is None and args.launch_pd is None:
            args.launch = scaling.min_instances
    launch = {"launch": args.launch, "serve_args": None if args.serve_args is None else tuple(shlex.split(args.serve_args))}
    if args.launch_pd is not None:
        p, sep, d = args.launch_pd.partition(":")
        if not (sep and p.isdigit() and d.isdigit() and int(p) and int(d)):
            raise ValueError(f"--launch-pd is P:D, prefill and decode instances (each >= 1), e.g. 1:2, got {args.launch_pd!r}")
        if scaling is not None and (args.launch or scaling.min_instances < 2):
            raise ValueError("--autoscale with --launch-pd sizes the P/D pools alone: no --launch, and MIN >= 2 "
                             "(one instance of each)")
        launch.update(launch_prefill=int(p), launch_decode=int(d))
    if args.config is not None:
        config = RouterConfig.from_file(args.config, policy=args.policy, **launch)
        config = RouterConfig(**{**config.__dict__, "instances": config.instances + tuple(args.instance),
                                 "prefill": config.prefill + tuple(args.prefill),
                                 "decode": config.decode + tuple(args.decode)})
    else:
        config = RouterConfig(instances=tuple(args.instance), prefill=tuple(args.prefill), decode=tuple(args.decode),
                              **{k: v for k, v in launch.items() if v is not None},
                              **({"policy": args.policy} if args.policy else {}))
    if args.rebalance and not ((config.prefill or config.launch_prefill) and (config.decode or config.launch_decode)):
        raise ValueError("--rebalance needs P/D pools (--prefill and --decode instances)")
    if args.launcher != "local" and not (config.launch or config.launch_prefill or config.launch_decode):
        raise ValueError("--launcher says where --launch / --launch-pd start instances: give one of them")
    if scaling is not None and not (config.launch or config.launch_prefill):
        raise ValueError("--autoscale needs instances the router starts (--launch N or --launch-pd P:D)")
    import asyncio

    from kvflow.api.server import APIConfig
    from kvflow.router.app import serve_router
    from kvflow.router.backend import RouterBackend

    key = args.api_key if args.api_key is not None else (os.environ.get("KVFLOW_API_KEY") or None)
    api = APIConfig(api_key=key, open_paths=tuple(p.strip() for p in args.open_paths.split(",") if p.strip()),
                    drain_timeout_s=args.drain_timeout)
    fleet, model = None, args.model
    pd = config.launch_prefill + config.launch_decode
    if config.launch + pd:
        from kvflow.router.fleet import FleetConfig, LocalFleet

        serve_args = config.serve_args
        given = _flag(serve_args, "--model")
        if given is None and model is not None:
            serve_args = ("--model", model, *serve_args)
        model = model if model is not None else given  # the router's tokenizer is the instances' model's
        from kvflow.controller.launcher import local_gpus

        if pd and _flag(serve_args, "--host-kv-bytes") is None:  # where a decode instance's pulled KV lands
            serve_args = (*serve_args, "--host-kv-bytes", "1G")
        if args.launcher == "ray":
            from kvflow.router.ray_fleet import RayFleet

            cuda = (_flag(serve_args, "--device") or "cpu").startswith("cuda")
            fleet = RayFleet(FleetConfig(config.launch + pd, serve_args), args.ray_address, num_gpus=1.0 if cuda else 0.0)
        else:
            gpus = tuple(local_gpus(_flag(serve_args, "--device") or "cpu"))  # several: one instance per GPU, in turn
            fleet = LocalFleet(FleetConfig(config.launch + pd, serve_args, gpus=gpus))
        urls = tuple(fleet.start())
        mixed, prefill, decode = urls[:config.launch], urls[config.launch:config.launch + config.launch_prefill], \
            urls[config.launch + config.launch_prefill:]
        config = RouterConfig(**{**config.__dict__, "instances": config.instances + mixed,
                                 "prefill": config.prefill + prefill, "decode": config.decode + decode})
        print(f"kvflow router: started {len(urls)} instance(s) ({', '.join(i.url for i in fleet.instances)}"
              + (f"; prefill {', '.join(prefill)}, decode {', '.join(decode)}" if pd else "")
              + f"), their logs in {fleet.log_dir}", file=sys.stderr)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)-9s [%(name)s] %(message)s"))
    logging.getLogger("kvflow").setLevel(args.log_level.upper())
    logging.getLogger("kvflow").addHandler(handler)
    try:
        backend = asyncio.run(RouterBackend.connect(config, model, args.wait, fleet))
        if scaling is not None:
            from kvflow.router.scaling import instance_config

            backend.scale(scaling, perf, instance_config(backend.max_model_len))
        if args.rebalance:
            from kvflow.router.roles import BalanceConfig

            backend.balance(BalanceConfig(args.ttft_slo, args.tpot_slo, interval_s=args.scale_interval))
        print(f"kvflow router: {backend.model_name} over {len(config.roles())} instance(s), policy {config.policy}, "
              f"on http://{args.host}:{args.port}", file=sys.stderr)
        return serve_router(backend, args.host, args.port, args.log_level, api)
    finally:
        if fleet is not None:  # (after a failed start too: no instance outlives the router)
            fleet.close()
