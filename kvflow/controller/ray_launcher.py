"""Workers as Ray actors: a `Launcher` that hands placement, start-up and process supervision to Ray.

`RayLauncher` reserves one placement-group bundle per pipeline stage (the CPUs of
`ClusterConfig.threads_per_worker`, and one GPU when the engine's device is CUDA) and starts each
stage as an actor in its bundle. The actor runs the real worker, `kvflow.worker`'s `main`, in its own
process, bound on its node's IP; the worker then does the usual handshake with the controller, and
worker-to-worker KV and steps flow over kvflow's ZeroMQ transports at the addresses the workers
report (Ray carries control only: the actor's creation, the cluster secret as a call argument, the
actor's death). The controller and HTTP server stay in the process that builds the launcher.

A handle's `poll()` is None while the worker runs; it turns into the worker's exit code when the
worker returns (0 after `Shutdown`), or 1 when it raised or its actor died (process killed, node
lost: Ray fails the pending call with `RayActorError`), so the controller's liveness check and
recovery see a dead actor exactly as a dead subprocess; `kill()` is `ray.kill`. A replacement is
one more `start` of the same name: a new actor in the same bundle.

Ray is imported only here, and only when a `RayLauncher` is built (or `connect` is called); the
placement format below needs no Ray.

Placement file (`kvflow serve --launcher ray --plan FILE`), JSON:

    {
      "version": 1,
      "strategy": "STRICT_SPREAD",                  optional: PACK | SPREAD | STRICT_SPREAD | STRICT_PACK
      "stages": {                                   optional; stages left out go wherever the strategy puts them
        "prompt-0": {"node_ip": "10.0.0.5"},         the Ray node with this IP (its `node:IP` resource)
        "token-0":  {"node_id": "6a1f...c3"},        this Ray node (hex id, as `ray list nodes` shows it)
        "token-1":  {"labels": {"zone": "b"}},       a node with these labels (`ray start --labels`)
        "token-2":  {"resources": {"fast_nic": 0.01}} a node offering these custom resources (`ray start --resources`)
      }
    }

Stage names are the controller's worker names, `<pipeline>-<stage>`: `colocated-0..depth-1`, or
`prompt-0..` and `token-0..` (`ClusterConfig.stage_names()`). A stage may combine keys; the
resources it names are reserved in its bundle (use small fractions so several stages fit on a node
offering 1). `Placement.to_dict()` writes the format back (for `kvflow plan` to emit).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from kvflow.config import ClusterConfig
from kvflow.wire import SECRET_ENV

log = logging.getLogger(__name__)

STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")
NODE_ID_LABEL = "ray.io/node-id"  # Ray's built-in label on every node
NODE_IP_SHARE = 0.001  # of a node's `node:IP` resource (1.0): pins a bundle without using it up
PLACEMENT_VERSION = 1


@dataclass(frozen=True)
class StagePlacement:
    """Where one stage must run; every field left empty leaves it free."""

    node_ip: str | None = None
    node_id: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key in ("node_ip", "node_id"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{key} must be a non-empty string, got {v!r}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.labels.items()):
            raise ValueError(f"labels must map strings to strings, got {self.labels!r}")
        for k, v in self.resources.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ValueError(f"resources must map names to positive amounts, got {k!r}: {v!r}")
            if k in ("CPU", "GPU"):
                raise ValueError(f"resources: {k} is set from the cluster config (threads per worker, device), not the plan")

    @property
    def bundle_resources(self) -> dict[str, float]:
        """What this placement adds to the stage's bundle."""
        extra = {f"node:{self.node_ip}": NODE_IP_SHARE} if self.node_ip else {}
        return {**extra, **{k: float(v) for k, v in self.resources.items()}}

    @property
    def label_selector(self) -> dict[str, str]:
        return {**self.labels, **({NODE_ID_LABEL: self.node_id} if self.node_id else {})}


@dataclass(frozen=True)
class Placement:
    """Which stage goes on which Ray node (the `--plan` file; format in the module docstring)."""

    stages: dict[str, StagePlacement] = field(default_factory=dict)
    strategy: str | None = None

    def __post_init__(self) -> None:
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Placement":
        if not isinstance(d, dict):
            raise ValueError(f"a placement is a JSON object, got {type(d).__name__}")
        unknown = set(d) - {"version", "strategy", "stages"}
        if unknown:
            raise ValueError(f"unknown placement keys {sorted(unknown)} (known: version, strategy, stages)")
        if d.get("version", PLACEMENT_VERSION) != PLACEMENT_VERSION:
            raise ValueError(f"placement version {d['version']!r} is not supported (only {PLACEMENT_VERSION})")
        stages = d.get("stages", {})
        if not isinstance(stages, dict):
            raise ValueError("placement 'stages' must map stage names to objects")
        keys = {f.name for f in dataclasses.fields(StagePlacement)}
        out = {}
        for name, s in stages.items():
            if not isinstance(s, dict) or set(s) - keys:
                raise ValueError(f"stage {name!r}: expected an object with keys among {sorted(keys)}, got {s!r}")
            out[name] = StagePlacement(**s)
        return cls(out, d.get("strategy"))

    @classmethod
    def load(cls, path: str | Path) -> "Placement":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read the placement file {path}: {e}") from e
        return cls.from_dict(d)

    @classmethod
    def spread(cls, stage_names: Sequence[str], node_ips: Sequence[str]) -> "Placement":
        """Stage i on node i of `node_ips` (in stage order: pipeline by pipeline), wrapping around
        when there are more stages than nodes; STRICT_SPREAD when every stage has a node of its own."""
        if not node_ips:
            raise ValueError("a placement needs at least one node")
        stages = {n: StagePlacement(node_ip=node_ips[i % len(node_ips)]) for i, n in enumerate(stage_names)}
        return cls(stages, "STRICT_SPREAD" if len(stage_names) <= len(node_ips) else "PACK")

    def to_dict(self) -> dict[str, Any]:
        stages = {n: {k: v for k, v in dataclasses.asdict(s).items() if v} for n, s in self.stages.items()}
        return {"version": PLACEMENT_VERSION, **({"strategy": self.strategy} if self.strategy else {}), "stages": stages}


@dataclass(frozen=True)
class RayConfig:
    """`address`: "auto" (a running cluster), "HOST:PORT" (its GCS), or None (`ray.init()`'s default:
    $RAY_ADDRESS, else a cluster started on this machine, else a new local one). `strategy`
    overrides the placement's; with neither it is PACK. `ready_timeout_s`: how long the placement
    group may wait for resources before start-up fails."""

    address: str | None = None
    strategy: str | None = None
    placement: Placement = Placement()
    ready_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.ready_timeout_s <= 0:
            raise ValueError("ready_timeout_s must be positive")

    @property
    def placement_strategy(self) -> str:
        return self.strategy or self.placement.strategy or "PACK"


def connect(address: str | None = None) -> str:
    """Join the Ray cluster (once per process) and return this node's IP: the interface the
    controller should bind so that workers on other nodes reach it."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address)
    return ray.util.get_node_ip_address()


class ActorLocation(NamedTuple):
    pid: int
    node_id: str
    node_ip: str


class StageActor:
    """The body of a stage's actor (wrapped by `ray.remote` at run time): one worker per process."""

    def where(self) -> ActorLocation:
        import ray

        return ActorLocation(os.getpid(), ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address())

    def run(self, controller_addr: str, name: str, secret_hex: str) -> int:
        """The worker, exactly as `python -m kvflow.worker` runs it, bound on this node's IP; returns
        when it shuts down."""
        import ray

        from kvflow.worker.__main__ import main

        os.environ[SECRET_ENV] = secret_hex  # this process is the worker's alone
        return main(["--controller", controller_addr, "--name", name, "--host", ray.util.get_node_ip_address()])


class RayWorkerHandle:
    """A `WorkerHandle` over one stage's actor (see the module docstring for `poll`)."""

    def __init__(self, name: str, actor, where_ref, run_ref) -> None:
        self.name, self.actor = name, actor
        self._where_ref = where_ref
        self._done: Future = run_ref.future()
        self._killed = False
        self.returncode: int | None = None
        self.error: str | None = None  # why the actor ended, when it did not return

    @property
    def where(self) -> ActorLocation:
        """The actor's process id, Ray node id and node IP (blocks until the actor has started)."""
        import ray

        return ActorLocation(*ray.get(self._where_ref))

    @property
    def pid(self) -> int | None:
        try:
            return self.where.pid
        except Exception:  # the actor died before it answered
            return None

    def poll(self) -> int | None:
        if self.returncode is None and self._done.done():
            self.returncode = self._outcome()
        return self.returncode

    def _outcome(self) -> int:
        from ray.exceptions import RayActorError

        try:
            return int(self._done.result())
        except RayActorError as e:
            self.error = f"Ray actor died: {e}"
        except Exception as e:  # the worker raised (RayTaskError)
            self.error = f"worker raised: {e}"
        if not self._killed:
            log.warning("stage %s: %s", self.name, self.error)
        return 1

    def kill(self) -> None:
        import ray

        self._killed = True
        ray.kill(self.actor, no_restart=True)

    def wait(self, timeout: float | None = None) -> int:
        """The exit code once the worker has ended (raises TimeoutError after `timeout` s); the actor
        is then ended too, so its process and bundle are free."""
        try:
            self._done.exception(timeout)
        except TimeoutError:
            raise TimeoutError(f"stage {self.name} still running after {timeout}s") from None
        code = self.poll()
        if not self._killed:
            self.kill()
        return code


class RayLauncher:
    """Starts each stage of `cluster` as a Ray actor in its bundle of one placement group (created
    here, at once for every stage; `close()` removes it and every actor in it)."""

    def __init__(self, cluster: ClusterConfig, config: RayConfig = RayConfig()) -> None:
        self.names = cluster.stage_names()
        unknown = sorted(set(config.placement.stages) - set(self.names))
        if unknown:
            raise ValueError(f"the placement names stages {unknown} that this layout does not have (it has {self.names})")
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        connect(config.address)
        self.num_cpus = cluster.threads_per_worker
        self.num_gpus = 1 if cluster.engine.device.startswith("cuda") else 0
        base = {"CPU": float(self.num_cpus), **({"GPU": float(self.num_gpus)} if self.num_gpus else {})}
        placed = [config.placement.stages.get(n, StagePlacement()) for n in self.names]
        self.bundles = [{**base, **p.bundle_resources} for p in placed]
        selectors = [p.label_selector for p in placed]
        self.strategy = config.placement_strategy
        self.pg = placement_group(self.bundles, strategy=self.strategy, name=f"kvflow-{uuid.uuid4().hex[:8]}",
                                  bundle_label_selector=selectors if any(selectors) else None)
        try:
            ray.get(self.pg.ready(), timeout=config.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"Ray could not place the {len(self.bundles)} stages ({self.strategy}) within {config.ready_timeout_s:g}s: "
                f"bundles {dict(zip(self.names, self.bundles))}, label selectors {selectors}; "
                f"the cluster has {ray.available_resources()} available") from None
        self._actor_cls = ray.remote(StageActor)
        self._closed = False

    def start(self, name: str, controller_addr: str, host: str, secret: bytes) -> RayWorkerHandle:
        """A new actor for stage `name` in its bundle (first start or replacement); `host` is not
        used: the worker binds its own node's IP."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if name not in self.names:
            raise ValueError(f"unknown stage {name!r} (this launcher places {self.names})")
        strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.names.index(name))
        actor = self._actor_cls.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, max_restarts=0,
                                        max_concurrency=2, scheduling_strategy=strategy).remote()
        where = actor.where.remote()
        return RayWorkerHandle(name, actor, where, actor.run.remote(controller_addr, name, secret.hex()))

    def close(self) -> None:
        """Remove the placement group (Ray ends every actor still in it). Idempotent."""
        if self._closed:
            return
        from ray.util.placement_group import remove_placement_group

        self._closed = True
        remove_placement_group(self.pg)
