"""`kvflow router`: one OpenAI-compatible endpoint over several `kvflow serve` instances ([router.md](router.md))."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path


def register(sub) -> None:
    from kvflow.router.policies import POLICIES

    r = sub.add_parser("router", help="route requests over several kvflow serve instances (one OpenAI endpoint)")
    r.add_argument("--instance", action="append", default=[], metavar="URL",
                   help="base URL of a kvflow serve instance, e.g. http://127.0.0.1:8001 (repeat for each)")
    r.add_argument("--config", type=Path, default=None,
                   help="YAML or JSON file of router settings (instances, policy, placement, health checks); "
                        "flags given here override it, --instance adds to its instances (default: none)")
    r.add_argument("--policy", default=None, choices=sorted(POLICIES), help="placement policy (default prefix_aware)")
    r.add_argument("--model", default=None,
                   help="the checkpoint the instances serve, for its tokenizer (default: the embedded SmolLM2-135M-Instruct)")
    r.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    r.add_argument("--port", type=int, default=8000, help="port to listen on")
    r.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a first instance to answer")
    r.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but --open-paths (default: $KVFLOW_API_KEY)")
    r.add_argument("--open-paths", default="/health,/metrics", help="comma-separated paths answered without the key")
    r.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests may run on shutdown")
    r.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="of the HTTP server's and kvflow's own log lines (stderr)")
    r.set_defaults(func=run_router)


def run_router(args) -> int:
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
