"""A pipeline-stage worker process: layers [i, j) of the model, a paged KV cache, and a role.

Start-up handshake (nothing but the controller's address, the worker's name, its bind interface and
the cluster secret come from the command line): the worker binds its step socket and says `Hello`;
the controller answers `Setup` (its `WorkerSpec` and the `EngineConfig` subtree); the worker loads
only its layers' tensors, builds its cache, starts its KV receiver (token role) and says `Ready`;
the controller answers `Route` (where outputs and KV go). Sized from GPU memory, the first `Setup`
has no pool: the worker measures with its layers loaded and says `Hello` again with it (`_sized`).

Then steps arrive on one ZeroMQ PULL socket (from the controller for stage 0, from the previous
stage otherwise) as deltas: the worker mirrors each request's block table and computes them
(`kvflow.worker.compute`). They leave for the next stage, or, from the last stage, as greedy rows'
ids and the other rows' logits for the controller. KV moves only through the KV connector
(`kvflow.streaming.connector`): a prompt worker sends each layer's KV as soon as the layer has
written it (background thread), a token worker receives it into its cache and reports `KVArrived`.
A heartbeat thread reports liveness. Messages that are not authentic or do not decode are dropped
and counted, never raised in a loop.

Replication (`kvflow.worker.replication`): every step, each stage of a replicating pipeline also copies
the KV the step appended to its replica. In a ring (depth >= 2, `ClusterConfig.replication="ring"`)
the next stage (x+1 mod depth) keeps it in a replica cache (the previous stage's layers, the same
block ids) and reports the replicated token counts (`Replicated`); with no other stage (depth 1, or
`replication="store"`) it goes to the controller's replica store, written in place where the store's
shared memory is mapped here. In a recovery the controller has the replica's holder send it back
into the replacement's cache and the previous stage refill the replica the replacement holds (`Restore`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading

import torch
import zmq

from kvflow.config import WorkerSpec, engine_from_dict, to_dict
from kvflow.engine.memory import check_pool_fits
from kvflow.kv.cache import KVCache
from kvflow.model.linear import adopt_small_paths, chosen_small_paths
from kvflow.model.llama import LlamaModel
from kvflow.model.loader import load_checkpoint, load_config
from kvflow.streaming.connector import KVReceiver, KVSender
from kvflow.streaming.hidden_ring import HiddenRing, open_ring
from kvflow.streaming.primitives import InStream, OutStream
from kvflow.worker.parent import Parent
from kvflow.worker import stage
from kvflow.worker.replication import Replicator, restore
from kvflow.worker.compute import Landed, StageCompute
from kvflow.worker.steps import LastSampled
from kvflow.wire import (
    SECRET_ENV, Fence, Heartbeat, Hello, KVArrived, Ready, Replicated, Restore, Route, Setup, Shutdown, Step, StepResult,
    WireError, WorkerError, decode, encode,
)

log = logging.getLogger(__name__)


class Worker(StageCompute):
    def __init__(self, controller_addr: str, name: str, host: str, secret: bytes, controller_pid: int | None = None) -> None:
        """`controller_pid`: the local controller process this worker must not outlive (a worker forked by
        the launcher's fork server); None: the process that started this one (its parent)."""
        self.controller_addr, self.name, self.host, self.secret = controller_addr, name, host, secret
        self.parent = Parent(controller_pid)
        self.ctx = zmq.Context()
        self.busy_s = 0.0
        self.steps = 0
        self.launched_ahead = 0  # steps launched on the device before the step before was read back
        self.dropped = 0
        self.epoch = 0
        self.stop = threading.Event()
        self.tables: dict[str, list[int]] = {}  # request -> this stage's block ids (mirrored from steps)
        self.last = LastSampled()  # what decode-ahead steps take as input
        self.ids_out: zmq.Socket | None = None  # (last stage, decoding ahead) stage 0's step socket
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.replica: KVCache | None = None  # the previous stage's KV, replicated
        self.replica_rx: KVReceiver | None = None
        self.replicator: Replicator | None = None  # this stage's appended KV -> its replica (next stage's, or the store's)
        self.hidden_in: HiddenRing | None = None  # where its input hidden states arrive (a stage after the first, local)
        self.hidden_out: HiddenRing | None = None  # the next stage's: its output goes there
        self._send_lock = threading.Lock()  # the controller socket is shared by compute and KV threads

    # ------------------------------------------------------------------ set-up
    def _recv(self, sock: zmq.Socket, timeout_ms: int | None = None):
        """Next authentic message on `sock` (None on timeout); anything else is dropped and counted."""
        while True:
            if timeout_ms is not None and not sock.poll(timeout_ms):
                return None, None
            frames = sock.recv_multipart()
            try:
                return decode(frames, self.secret)
            except WireError as e:
                self.dropped += 1
                if self.dropped & (self.dropped - 1) == 0:  # 1st, 2nd, 4th, ...: no log flood
                    log.warning("%s dropped a message (%d so far): %s", self.name, self.dropped, e)

    def _to_controller(self, msg, tensor=None) -> None:
        with self._send_lock:
            self.ctrl.send_multipart(encode(msg, self.secret, tensor))

    def _setup(self, setup: Setup) -> None:
        self.spec = spec = WorkerSpec(**setup.spec)
        self.engine_cfg = ecfg = engine_from_dict(setup.engine)
        self.epoch = setup.epoch
        torch.set_num_threads(spec.threads)
        layers = (spec.layer_start, spec.layer_end)
        mc, _ = load_config(ecfg.model)
        if spec.layer_end > mc.num_layers:
            raise ValueError(f"layers [{spec.layer_start}, {spec.layer_end}) exceed the model's {mc.num_layers}")
        ck = load_checkpoint(ecfg.model, want=LlamaModel.tensor_filter(mc, layers))  # only this stage's tensors
        if spec.small_paths:  # a replacement: its predecessor's choice, not measured again (unless it cannot run here)
            adopt_small_paths(ecfg.torch_dtype, spec.small_paths)
        self.model = LlamaModel.from_state_dict(ck.config, ck.state_dict, layers, dtype=ecfg.torch_dtype, device=ecfg.device,
                                                deterministic=ecfg.deterministic)
        self.device = torch.device(ecfg.device)
        if ecfg.gpu_memory_utilization is not None:
            spec = self._sized(spec, ecfg, ck.config)
        (self.cache, self.compute_cache, self.swapper, self.graphs, self.replica, self.hidden_in,
         self.tiers) = stage.build(spec, ecfg, ck.config, self.model, self.name)
        if self.graphs is not None and self.graphs.ahead:  # (its steps may be launched behind others: `_next`)
            self.landed = Landed(self.ctx)
            self._poller = zmq.Poller()
            self._poller.register(self.step_in, zmq.POLLIN)
            self._poller.register(self.landed.sock, zmq.POLLIN)

    def _sized(self, spec: WorkerSpec, ecfg, mc) -> WorkerSpec:
        """The pools sized from GPU memory: measure what this stage's layers leave (`stage.measure`).
        At start-up (no pool yet) say Hello again with it and take the spec of the Setup that answers,
        with the pool the controller took over every stage; a replacement's pool (a live pipeline's,
        which cannot change) must fit what the GPU has left."""
        mem = stage.measure(self.model, ecfg, mc)
        if spec.pool_blocks:
            check_pool_fits(mem, ecfg.gpu_memory_utilization, spec.swap_regions * spec.swap_region_blocks or spec.pool_blocks)
            return spec
        self._to_controller(Hello(self.name, self.step_addr, to_dict(mem)))
        setup = self._expect(Setup)
        self.spec, self.epoch = WorkerSpec(**setup.spec), setup.epoch
        return self.spec

    def run(self) -> None:
        self.step_in = self.ctx.socket(zmq.PULL)
        port = self.step_in.bind_to_random_port(f"tcp://{self.host}")
        self.ctrl = self.ctx.socket(zmq.PUSH)
        self.ctrl.setsockopt(zmq.LINGER, 1000)
        self.ctrl.connect(self.controller_addr)
        self.step_addr = f"tcp://{self.host}:{port}"
        self._to_controller(Hello(self.name, self.step_addr))
        setup = self._expect(Setup)
        try:
            self._setup(setup)
        except Exception as e:
            self._to_controller(WorkerError(self.name, f"start-up failed: {type(e).__name__}: {e}"))
            raise
        kv_addr = replica_addr = ""
        from kvflow.streaming.transports.tcp_receiver import TcpReceiver

        if self.spec.role == "token" or self.spec.replicated:  # hand-offs, or a restore after a failure
            rx = TcpReceiver(self.host, pinned=self.cache.device.type == "cuda")
            kv_addr = rx.address
            self.receiver = KVReceiver(self.cache, InStream(rx, secret=self.secret), self._kv_complete, self._kv_dropped)
            self.receiver.start()
        if self.replica is not None:
            rx = TcpReceiver(self.host)
            replica_addr = rx.address
            self.replica_rx = KVReceiver(self.replica, InStream(rx, secret=self.secret), self._replicated, self._kv_dropped,
                                         increments=True)
            self.replica_rx.start()
        self._to_controller(Ready(self.name, kv_addr, replica_addr, self.model.kernel_variant,
                                  self.replica is not None and self.replica.shared, self.hidden_in is not None,
                                  chosen_small_paths(self.engine_cfg.torch_dtype)))
        self.out = None
        self._route(self._expect(Route))
        hb = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
        hb.start()
        try:
            self._loop()
        finally:
            self.stop.set()
            hb.join(2.0)
            if getattr(self, "_intake_thread", None) is not None:
                self._intake_thread.join(2.0)  # it polls the step socket: done before the context goes
            for t in (self.sender, self.replicator, self.receiver, self.replica_rx, self.swapper, self.hidden_in, self.hidden_out,
                      self.landed):
                if t is not None:
                    t.close()
            self.ctx.destroy(linger=0)

    def _route(self, route: Route) -> None:
        """Connect to the next stage (or the controller) and, as a prompt worker, to the token stages
        receiving KV. Sent at start and again after a failure, when a neighbour was replaced."""
        if self.out is not None:
            self.out.close(0)
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 1000)
        self.out.connect(route.next_addr)
        if self.ids_out is not None:
            self.ids_out.close(0)
        self.ids_out = None
        if route.ids_to:
            self.ids_out = self.ctx.socket(zmq.PUSH)
            self.ids_out.setsockopt(zmq.LINGER, 0)
            self.ids_out.connect(route.ids_to)
        if self.spec.role == "prompt":
            from kvflow.streaming.transports.tcp import TcpSender

            if self.sender is not None:
                self.sender.close()
                for o in self.sender.outs.values():
                    o.sender.close()
            outs = {int(d): OutStream(TcpSender(addr), f"{self.name}->{d}@{self.epoch}", self.secret) for d, _, _, addr in route.kv_peers}
            self.sender = KVSender(self.cache, self.spec.stage, outs, mode=self.spec.kv_send_mode)
        if self.replicator is not None:  # rewired after a failure: the old peer may be gone, do not wait
            self.replicator.close(wait=False)
            self.replicator = None
        if self.hidden_out is not None and self.hidden_out.name != route.hidden_to:
            self.hidden_out.close()
            self.hidden_out = None
        if route.hidden_to and self.hidden_out is None:
            self.hidden_out = open_ring(route.hidden_to, self.device, self.name)
        if route.replica_to or route.replica_shm:
            self.replicator = Replicator(self.cache, self.spec.stage, self.name, route, self.epoch, self.secret,
                                         self._to_controller)

    def _expect(self, cls):
        while True:
            msg, _ = self._recv(self.step_in, 1000)
            if isinstance(msg, cls):
                return msg
            if msg is None and self.parent.gone():
                raise SystemExit(f"{self.name}: the controller went away during start-up")
            if msg is not None:
                self.dropped += 1

    def _intake(self) -> None:
        """Swapping: receive messages ahead of the compute thread, mirror the block tables and start
        each step's swap-in (in order) as soon as the step arrives, while earlier steps compute."""
        while not self.stop.is_set():
            msg, tensor = self._recv(self.step_in, 200)
            prep = None
            try:
                if isinstance(msg, Step):
                    prep = self._prepare(msg)
                    if prep.swap:
                        self.swapper.prefetch((msg.epoch, msg.batch), msg.swap_region, prep.swap)
                elif isinstance(msg, Fence) and msg.tables:
                    self.tables.clear()
                    self.swapper.forget_prefetched()
            except Exception as e:
                prep = e
            self._inbox.put((msg, tensor, prep))

    def _next(self):
        f = self.last.flight
        if f is not None:  # a step that comes first may be launched behind it; else it is read back once done
            ready = dict(self._poller.poll(1000))
            if self.step_in not in ready:
                if self.landed.sock in ready and self.landed.rung() >= f.ticket:
                    self._land()
                return None, None, None
        if self.swapper is None:
            msg, tensor = self._recv(self.step_in, 1000)
            return msg, tensor, None
        try:
            return self._inbox.get(timeout=1.0)
        except queue.Empty:
            return None, None, None

    def _loop(self) -> None:
        if self.swapper is not None:
            self._inbox: queue.Queue = queue.Queue()
            self._intake_thread = threading.Thread(target=self._intake, name="intake", daemon=True)
            self._intake_thread.start()
        while True:
            msg, tensor, prep = self._next()
            if self.last.overdue():  # a bug, not a slow peer: recover rather than hang
                held = self.last.held[0][0]
                self.last.drop_held()
                self._to_controller(WorkerError(self.name, f"decode-ahead step {held.batch} got no input ids in "
                                                f"{self.last.HOLD_LIMIT_S:.0f} s", held.epoch))
            if msg is None:
                if self.parent.gone():  # the controller that started us is gone: do not linger
                    log.warning("controller process exited; worker %s stops", self.name)
                    return
                continue
            if self.last.flight is not None and not isinstance(msg, Step):
                self._land()  # (before a fence, a new route, a restore or the end)
            if isinstance(msg, Step):
                if msg.epoch < self.epoch:
                    self.dropped += 1  # from before a recovery: stale
                    if self.swapper is not None:
                        self.swapper.done((msg.epoch, msg.batch))
                    continue
                self.epoch = msg.epoch
                for item in self.last.admit((msg, tensor, prep)):  # (decoding ahead: held until the last stage's ids are in)
                    self._run(*item)
            elif isinstance(msg, StepResult):  # (a decode-ahead first stage: the ids the last stage sampled)
                if msg.epoch >= self.epoch:  # (one of a batch a recovery voided is moot)
                    self.last.take(msg, self.tables)
                for item in self.last.released():
                    self._run(*item)
            elif isinstance(msg, Fence):
                self.epoch = max(self.epoch, msg.epoch)
                if self.replicator is not None:  # (its copies in flight land before a restore reads or refills)
                    self.replicator.drain()
                self.dropped += self.last.drop_held()  # (steps of an older epoch, waiting for ids that will not come)
                if msg.tables and self.swapper is None:  # (the intake thread owns the tables when swapping)
                    self.tables.clear()
                    self.last.clear()
                if msg.kv and self.receiver is not None:
                    self.receiver.fence(msg.epoch)
                if self.replica_rx is not None:  # the replica keeps its blocks; partial increments are void
                    self.replica_rx.fence(msg.epoch)
            elif isinstance(msg, Route):
                self._route(msg)
            elif isinstance(msg, Restore):
                try:
                    restore({"main": self.cache, "replica": self.replica}.get(msg.source), msg, self.name, self.secret)
                except Exception as e:
                    log.exception("restore failed")
                    self._to_controller(WorkerError(self.name, f"restore failed: {type(e).__name__}: {e}", msg.epoch))
            elif isinstance(msg, Shutdown):
                return
            else:
                self.dropped += 1

    # ------------------------------------------------------------------ token role: KV arrivals
    def _kv_complete(self, rids: list[str], spans: list[tuple[int, int]]) -> None:
        self._to_controller(KVArrived(self.name, rids))

    def _replicated(self, rids: list[str], spans: list[tuple[int, int]]) -> None:
        self._to_controller(Replicated(self.name, rids, [a for a, _ in spans], [b for _, b in spans]))

    def _kv_dropped(self, message: str) -> None:
        """A chunk that did not verify (not authentic, corrupted) or was not planned: dropped and
        counted. Its sender learns it from the acknowledgement; a real transfer failure is reported
        by the sending worker, so bytes from a stranger cannot make the controller fail a worker."""
        self.dropped += 1
        if self.dropped & (self.dropped - 1) == 0:
            log.warning("%s dropped a KV chunk (%d so far): %s", self.name, self.dropped, message)

    # ------------------------------------------------------------------ liveness
    def _heartbeat(self) -> None:
        while not self.stop.wait(self.spec.heartbeat_s):
            sent = self.sender.nbytes if self.sender is not None else 0
            got = self.receiver.nbytes if self.receiver is not None else 0
            replicated = self.replicator.nbytes if self.replicator is not None else 0
            swap = dict(self.swapper.stats) if self.swapper is not None else {}
            hidden = self.hidden_out.nbytes if self.hidden_out is not None else 0
            self._to_controller(Heartbeat(self.name, self.busy_s, self.steps, sent, got, self.dropped, replicated, hidden, swap,
                                          self.launched_ahead))


def run_worker(controller_addr: str, name: str, host: str, secret: bytes | None = None,
               controller_pid: int | None = None) -> None:
    logging.basicConfig(level=os.environ.get("KVFLOW_LOG", "WARNING"))
    if secret is None:
        hexed = os.environ.get(SECRET_ENV)
        if not hexed:
            raise SystemExit(f"the cluster secret is missing: set {SECRET_ENV} (the controller prints it)")
        secret = bytes.fromhex(hexed)
    Worker(controller_addr, name, host, secret, controller_pid).run()
