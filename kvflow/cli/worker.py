"""`kvflow worker --controller HOST:PORT ...`: start one pipeline-stage worker (on this or another host)."""

from __future__ import annotations

import argparse


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--controller", required=True, help="controller address HOST:PORT (or tcp://HOST:PORT)")
    p.add_argument("--name", required=True, help="the worker name the controller expects, e.g. colocated-0")
    p.add_argument("--layers", required=True, help="layer range START:END held by this stage")
    p.add_argument("--role", default="both", choices=["both", "prompt", "token"])
    p.add_argument("--model", default=None)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--host", default="127.0.0.1", help="address this worker binds and advertises")
    p.add_argument("--threads", type=int, default=1)


def register(sub) -> None:
    p = sub.add_parser("worker", help="run one pipeline-stage worker for a kvflow controller")
    _add_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from kvflow.worker.worker import WorkerConfig, run_worker

    try:
        a, b = (int(x) for x in args.layers.split(":"))
    except ValueError:
        raise ValueError(f"--layers must be START:END, got {args.layers!r}") from None
    addr = args.controller if args.controller.startswith("tcp://") else f"tcp://{args.controller}"
    run_worker(
        WorkerConfig(
            name=args.name, controller_addr=addr, layer_start=a, layer_end=b, role=args.role, model=args.model,
            num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, host=args.host, threads=args.threads,
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvflow worker")
    _add_args(p)
    return run(p.parse_args(argv))
