"""`kvflow router`: one OpenAI-compatible endpoint over several `kvflow serve` instances ([router.md](router.md))."""

from __future__ import annotations

import argparse
import logging
import os
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
    r.add_argument("--config", type=existing_path, default=None,
                   help="YAML or JSON file of router settings (instances, policy, placement, health checks); flags "
                        "given here override it, --instance adds to its instances (default: none)")
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


def run_router(args) -> int:
    import asyncio

    from kvflow.api.server import APIConfig
    from kvflow.router.app import serve_router
    from kvflow.router.backend import RouterBackend
    from kvflow.router.config import RouterConfig

    if args.config is not None:
        config = RouterConfig.from_file(args.config, policy=args.policy)
        if args.instance:
            config = RouterConfig(**{**config.__dict__, "instances": config.instances + tuple(args.instance)})
    else:
        config = RouterConfig(instances=tuple(args.instance), **({"policy": args.policy} if args.policy else {}))
    key = args.api_key if args.api_key is not None else (os.environ.get("KVFLOW_API_KEY") or None)
    api = APIConfig(api_key=key, open_paths=tuple(p.strip() for p in args.open_paths.split(",") if p.strip()),
                    drain_timeout_s=args.drain_timeout)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)-9s [%(name)s] %(message)s"))
    logging.getLogger("kvflow").setLevel(args.log_level.upper())
    logging.getLogger("kvflow").addHandler(handler)
    backend = asyncio.run(RouterBackend.connect(config, args.model, args.wait))
    print(f"kvflow router: {backend.model_name} over {len(config.instances)} instance(s), policy {config.policy}, "
          f"on http://{args.host}:{args.port}", file=sys.stderr)
    return serve_router(backend, args.host, args.port, args.log_level, api)
