"""The controller's worker processes: starting them, the handshake, wiring them to each other,
messages to and from them, liveness, and stopping them. Knows nothing of scheduling."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import TYPE_CHECKING

import torch
import zmq

from kvflow.config import ClusterConfig, WorkerSpec, to_dict
from kvflow.controller.launcher import Launcher
from kvflow.controller.pipeline import Pipeline, StageHandle
from kvflow.engine.memory import StageMemory
from kvflow.streaming.hidden_ring import create_ring
from kvflow.streaming.transports.shm_segment import release
from kvflow.wire import Hello, Ready, Route, Setup, Shutdown, WireError, WorkerError, decode, encode

if TYPE_CHECKING:
    from kvflow.controller.replica_store import ReplicaStore

log = logging.getLogger(__name__)
PEER_EXIT_WAIT_S = 2.0  # how long a stream peer's disconnection waits for a process exit to blame instead
RING_SLOT_MAX = 64 << 20  # a hidden-state ring's slots hold a step of the pipeline's token budget, up to this


class StartError(RuntimeError):
    """A worker did not come up (exited, reported an error, or timed out)."""


class Workers:
    """Every stage process of a controller's pipelines, and the sockets to them: one inbox (PULL)
    that every worker sends to, one PUSH socket per stage; and the hidden-state rings between
    adjacent stages it started (`streaming.hidden_ring`: `token_bytes` is one token's hidden state)."""

    def __init__(self, cfg: ClusterConfig, stages: list[StageHandle], launcher: Launcher, secret: bytes, token_bytes: int = 0) -> None:
        self.cfg, self.launcher, self.secret, self.token_bytes = cfg, launcher, secret, token_bytes
        self.pipelines: list[Pipeline] = []  # (`attach`, once their pools are sized)
        self.store: "ReplicaStore | None" = None
        self.rings: dict[str, shared_memory.SharedMemory] = {}  # receiving stage -> its ring
        self.stages = {s.name: s for s in stages}
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        port = self.inbox.bind_to_random_port(f"tcp://{cfg.host}")
        self.address = f"tcp://{cfg.host}:{port}"
        self.to_stage: dict[str, zmq.Socket] = {}
        self.dropped_messages = 0  # inbox messages that were not authentic or did not decode
        self.kernel_variants: dict[str, str] = {}  # each stage's `Ready.kernel_variant`

    def attach(self, pipelines: list[Pipeline], store: "ReplicaStore | None") -> None:
        """The pipelines of the stages, made once their pools are sized, and the store of their replicas."""
        self.pipelines, self.store = pipelines, store

    def pipeline_of(self, s: StageHandle) -> Pipeline:
        return next(p for p in self.pipelines if s in p.stages)

    # --- messages ------------------------------------------------------------------------------

    def send(self, name: str, msg, tensor: torch.Tensor | None = None) -> None:
        self.to_stage[name].send_multipart(encode(msg, self.secret, tensor))

    def receive(self, timeout_ms: int) -> tuple[object | None, torch.Tensor | None] | None:
        """The next inbox message within `timeout_ms` (0: only one already there): (message,
        tensor), (None, None) for one that was dropped, or None when there was none."""
        if timeout_ms and not self.inbox.poll(timeout_ms):
            return None
        try:
            frames = self.inbox.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        try:
            return decode(frames, self.secret)
        except WireError as e:
            self.dropped_messages += 1
            if self.dropped_messages & (self.dropped_messages - 1) == 0:  # 1st, 2nd, 4th, ...: no log flood
                log.warning("dropped a message on the controller port (%d so far): %s", self.dropped_messages, e)
            return None, None

    # --- life cycle ----------------------------------------------------------------------------

    def launch(self, s: StageHandle) -> None:
        s.process = self.launcher.start(s.name, self.address, self.cfg.host, self.secret)
        if s.process is not None:
            log.info("started worker %s (pid %s)", s.name, s.process.pid)

    def handshake(self, names: set[str], epoch: int, other: Callable[[object, torch.Tensor | None], None] | None,
                  size: Callable[[dict[str, StageMemory]], None] | None = None) -> None:
        """Hello -> Setup (spec + engine config) -> Ready, for the stages `names`. Any other message
        that arrives meanwhile (a recovery runs while the rest of the cluster works) goes to `other`.
        With `size` (the pools sized from GPU memory, at start-up) there is one round more: the first
        Setup has no pool (`WorkerSpec.pool_blocks` 0), each stage loads its layers, measures and says
        Hello again with what it measured (`Hello.memory`); once every stage has, `size` makes the
        pipelines (`attach`) and each stage gets its Setup again, with its pool. A replacement's Setup
        has its pipeline's pool: the stage checks that it fits."""
        deadline = time.monotonic() + self.cfg.start_timeout_s
        hello, ready = set(names), set(names)
        measured: dict[str, StageMemory] = {}
        while ready:
            for name in ready:
                proc = self.stages[name].process
                if proc is not None and proc.poll() is not None:
                    raise StartError(f"worker {name} exited with code {proc.poll()} during start-up")
            if time.monotonic() > deadline:
                raise StartError(f"workers {sorted(ready)} did not start within {self.cfg.start_timeout_s}s")
            got = self.receive(200)
            if got is None or got[0] is None:
                continue
            msg, tensor = got
            if isinstance(msg, Hello) and msg.name in hello:
                self._connect(self.stages[msg.name], msg.step_addr)
                spec = self._spec(self.stages[msg.name]) if size is None else self._unsized_spec(self.stages[msg.name])
                self.send(msg.name, Setup(to_dict(spec), to_dict(self.cfg.engine), epoch))
                hello.discard(msg.name)
            elif isinstance(msg, Hello) and msg.memory and size is not None and msg.name in ready and msg.name not in measured:
                try:
                    measured[msg.name] = StageMemory(**msg.memory)
                except TypeError as e:  # (a worker of another kvflow version)
                    raise StartError(f"worker {msg.name} reported a measurement this controller cannot read: {e}") from None
                if len(measured) == len(names):  # every stage loaded and measured: the pools, then each its Setup
                    size(measured)
                    for name in sorted(measured):
                        self.send(name, Setup(to_dict(self._spec(self.stages[name])), to_dict(self.cfg.engine), epoch))
            elif isinstance(msg, Ready) and msg.name in ready and msg.name not in hello:
                self._same_kernel_variant(msg.name, msg.kernel_variant)
                s = self.stages[msg.name]
                s.kv_addr, s.replica_addr, s.last_heartbeat = msg.kv_addr, msg.replica_addr, time.monotonic()
                s.replica_shm, s.hidden_shm, s.small_paths = msg.replica_shm, msg.hidden_shm, msg.small_paths
                ready.discard(msg.name)
            elif isinstance(msg, WorkerError) and msg.name in ready:
                raise StartError(f"worker {msg.name} failed: {msg.message}")
            elif other is not None and not isinstance(msg, WorkerError):
                other(msg, tensor)  # (a worker failing meanwhile is found by the next liveness check)

    def _same_kernel_variant(self, name: str, variant: str) -> None:
        """Every stage must compute with one kernel variant: a request's steps move between stages
        (prompt to token pipeline, a replaced worker, a resumed replica) and would change its tokens."""
        for other, theirs in self.kernel_variants.items():
            if other != name and theirs != variant:
                raise StartError(f"worker {name} computes with kernels {variant!r} but {other} with {theirs!r}: "
                                 "a request moved between them would change its tokens (run every worker on "
                                 "the same kind of CPU with the same --deterministic)")
        self.kernel_variants[name] = variant

    def _connect(self, s: StageHandle, step_addr: str) -> None:
        s.step_addr = step_addr
        old = self.to_stage.pop(s.name, None)
        if old is not None:
            old.close(0)
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(step_addr)
        self.to_stage[s.name] = sock

    def _spec(self, s: StageHandle) -> WorkerSpec:
        p = self.pipeline_of(s)
        mode, regions, per = self.cfg.replicates(p.spec), p.sched.config.swap_regions, p.sched.config.swap_region_blocks
        rl = p.stages[(s.stage - 1) % p.depth].layers if mode == "ring" else (-1, -1)
        shm = self.store.segment(p.name, (s.stage - 1) % p.depth) if mode == "ring" and s.process is not None else ""
        return WorkerSpec(s.name, s.stage, s.layers[0], s.layers[1], p.role, self.cfg.threads_per_worker,
                          self.cfg.kv_send_mode, replica_layer_start=rl[0], replica_layer_end=rl[1], replica_shm=shm,
                          replicated=mode is not None, host_kv_slots=p.kv_manager.host.num_slots if p.kv_manager.host else 0,
                          disk_kv_slots=p.kv_manager.disk.num_slots if p.kv_manager.disk else 0, swap_regions=regions,
                          swap_region_blocks=per, pool_blocks=p.kv_manager.num_blocks, hidden_shm=self._ring(p, s),
                          small_paths=s.small_paths)  # (a replacement: what its predecessor chose, `Ready`)

    def _unsized_spec(self, s: StageHandle) -> WorkerSpec:
        """What a stage is before its pool is sized: its layers, to load and measure over."""
        role = next(p.role for p in self.cfg.pipelines() if s.name in map(p.stage_name, range(p.depth)))
        return WorkerSpec(s.name, s.stage, s.layers[0], s.layers[1], role, self.cfg.threads_per_worker, self.cfg.kv_send_mode)

    def _ring(self, p: Pipeline, s: StageHandle) -> str:
        """The ring `s` takes its input hidden states in ("": none): made once for a stage after the
        first whose process and its predecessor's this controller started (on this host), with a
        slot per batch the pipeline keeps in flight; none where /dev/shm cannot hold it, or with
        `KVFLOW_HIDDEN_RINGS=0` (the hidden states on the step messages, for comparisons)."""
        prev = p.stages[s.stage - 1] if s.stage > 0 else None
        if prev is None or s.process is None or prev.process is None or not self.token_bytes \
                or os.environ.get("KVFLOW_HIDDEN_RINGS") == "0":
            return ""
        if s.name not in self.rings:
            budget = p.sched.config.max_num_batched_tokens or p.sched.config.max_num_seqs
            try:
                self.rings[s.name] = create_ring(p.max_in_flight, min(budget * self.token_bytes, RING_SLOT_MAX))
            except OSError as e:
                log.warning("no hidden-state ring for %s (%s): its input travels on the step messages", s.name, e)
                return ""
        return self.rings[s.name].name

    def wire(self, token: Pipeline | None) -> None:
        """Tell every stage where its output goes (the next stage, or the controller), which token
        stages take a prompt stage's KV, and where its KV replica goes: the next stage's replica
        port, or the store's; and the replica's shared-memory segment to a worker whose process this
        controller can kill, where the replica is kept in it (the store's; a ring holder that
        mapped it, `Ready.replica_shm`), to write in place (`ReplicaStore`). The last stage of a
        deeper pipeline that decodes ahead also sends its results to stage 0 (`Route.ids_to`). A
        stage whose successor mapped its hidden-state ring writes its output there (`Route.hidden_to`)."""
        bounds = token.layer_bounds if token is not None else []
        for p in self.pipelines:
            for i, s in enumerate(p.stages):
                nxt = p.stages[i + 1].step_addr if i + 1 < p.depth else self.address
                peers = [[t.stage, t.layers[0], t.layers[1], t.kv_addr] for t in token.stages] if p.role == "prompt" else []
                mode = self.cfg.replicates(p.spec)
                holder = p.stages[(i + 1) % p.depth]
                replica_to = (holder.replica_addr if mode == "ring" else self.store.addresses[(p.name, i)] if mode == "store" else "")
                kept = mode == "store" or (mode == "ring" and holder.replica_shm)
                shm = self.store.segment(p.name, i) if kept and s.process is not None else ""
                ahead = p.sched.config.decode_ahead and p.depth > 1 and i == p.depth - 1  # (its ids to stage 0)
                ring = self.rings[p.stages[i + 1].name].name if i + 1 < p.depth and p.stages[i + 1].hidden_shm else ""
                self.send(s.name, Route(nxt, peers, bounds, replica_to, shm, p.stages[0].step_addr if ahead else "", ring))

    def lost(self) -> tuple[StageHandle, str] | None:
        """The first live stage whose process exited or whose heartbeats stopped, and why."""
        now = time.monotonic()
        for s in self.stages.values():
            if not s.alive:
                continue
            code = s.process.poll() if s.process is not None else None
            if code is not None:
                return s, f"worker {s.name} (layers {s.layers[0]}-{s.layers[1] - 1}) died (exit code {code})"
            if now - s.last_heartbeat > self.cfg.heartbeat_timeout_s:
                return s, f"worker {s.name} stopped sending heartbeats for {now - s.last_heartbeat:.1f}s"
        return None

    def await_exit(self, timeout_s: float = PEER_EXIT_WAIT_S) -> bool:
        """Wait until some live stage's process has exited (True), or `timeout_s` (False). A worker
        whose stream peer disconnected reports it at once; the peer's process, if it died, may not be
        reaped yet, and the dead one is the stage to recover."""
        deadline = time.monotonic() + timeout_s
        while not any(s.alive and s.process is not None and s.process.poll() is not None for s in self.stages.values()):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def running(self, *stages: StageHandle) -> bool:
        return all(s.process is None or s.process.poll() is None for s in stages)

    def fence(self, s: StageHandle) -> None:
        """Make sure `s`'s process is gone: a worker that only hung must never write again."""
        if s.process is not None and s.process.poll() is None:
            s.process.kill()
            s.process.wait()

    def kill_all(self) -> None:
        for s in self.stages.values():
            if s.process is not None and s.process.poll() is None:
                s.process.kill()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask every worker to stop, wait up to `timeout_s` for all of them, kill the rest."""
        for name in self.to_stage:
            try:
                self.to_stage[name].send_multipart(encode(Shutdown(), self.secret), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout_s
        for s in self.stages.values():
            if s.process is not None:
                try:
                    s.process.wait(max(0.1, deadline - time.monotonic()))
                except Exception:
                    s.process.kill()
                    s.process.wait()

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        for seg in self.rings.values():
            release(seg)
        self.rings.clear()
