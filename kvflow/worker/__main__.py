"""`python -m kvflow.worker --controller ADDR --name NAME [--host HOST]`: one stage process (what the
launcher starts and `kvflow worker` runs). Everything else comes from the controller's handshake."""

import argparse

from kvflow.worker.worker import run_worker


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvflow.worker")
    p.add_argument("--controller", required=True, help="controller address HOST:PORT (or tcp://HOST:PORT)")
    p.add_argument("--name", required=True, help="the worker name the controller expects, e.g. colocated-0")
    p.add_argument("--host", default="127.0.0.1", help="address this worker binds and advertises")
    args = p.parse_args(argv)
    addr = args.controller if args.controller.startswith("tcp://") else f"tcp://{args.controller}"
    run_worker(addr, args.name, args.host)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
