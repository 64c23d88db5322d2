"""`kvflow worker --controller HOST:PORT --name NAME --host HOST`: start one pipeline-stage worker (on
this or another host). Its layers, role, model and KV settings come from the controller's handshake;
the cluster secret comes from KVFLOW_CLUSTER_SECRET, as `kvflow serve --external-workers` prints it."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("worker", help="run one pipeline-stage worker for a kvflow controller")
    p.add_argument("--controller", required=True, help="controller address HOST:PORT (or tcp://HOST:PORT)")
    p.add_argument("--name", required=True, help="the worker name the controller expects, e.g. colocated-0")
    p.add_argument("--host", default="127.0.0.1", help="address this worker binds and advertises")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvflow.worker.__main__ import main

    return main(["--controller", args.controller, "--name", args.name, "--host", args.host])
