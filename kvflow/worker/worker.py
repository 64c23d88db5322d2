"""A pipeline-stage worker process: layers [i, j) of the model, a paged KV cache, and a role.

Roles: "both" (colocated: prompts and tokens), "prompt" (streams each prompt's KV layer by layer to
the token workers owning those layers) and "token" (receives that KV into its cache and reports
when a request's KV is complete). Steps arrive on one ZeroMQ PULL socket (from the controller for
stage 0, from the previous stage otherwise) and leave for the next stage, or, from the last stage,
as last-token logits for the controller. A heartbeat thread reports liveness and busy time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch
import zmq

from kvflow.controller.messages import (
    Free, Heartbeat, KVArrived, Ready, Shutdown, Step, StepResult, Wire, WorkerError, decode, encode,
)
from kvflow.kv.cache import KVCache, KVLayout
from kvflow.model.batch import ForwardBatch, SeqSlice
from kvflow.model.llama import LlamaModel
from kvflow.model.loader import load_checkpoint, load_config

log = logging.getLogger(__name__)

ROLES = ("both", "prompt", "token")


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    controller_addr: str  # the controller's PULL socket, tcp://host:port
    layer_start: int
    layer_end: int
    role: str = "both"
    model: str | None = None
    num_kv_blocks: int = 1024
    block_size: int = 16
    host: str = "127.0.0.1"
    threads: int = 1
    heartbeat_s: float = 0.25

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"bad layer range [{self.layer_start}, {self.layer_end})")
        if self.num_kv_blocks <= 0 or self.block_size <= 0 or self.threads <= 0 or self.heartbeat_s <= 0:
            raise ValueError("num_kv_blocks, block_size, threads and heartbeat_s must be positive")


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        torch.set_num_threads(cfg.threads)
        layers = (cfg.layer_start, cfg.layer_end)
        mc, _ = load_config(cfg.model)
        if cfg.layer_end > mc.num_layers:
            raise ValueError(f"layers [{cfg.layer_start}, {cfg.layer_end}) exceed the model's {mc.num_layers}")
        ck = load_checkpoint(cfg.model, want=LlamaModel.tensor_filter(mc, layers))  # only this stage's tensors
        self.model = LlamaModel.from_state_dict(ck.config, ck.state_dict, layers)
        layout = KVLayout.for_model(ck.config, cfg.num_kv_blocks, cfg.block_size, (cfg.layer_start, cfg.layer_end))
        self.cache = KVCache(layout)
        self.ctx = zmq.Context()
        self.busy_s = 0.0
        self.steps = 0
        self.kv_sent = 0
        self.kv_received = 0
        self.stop = threading.Event()
        self.kv_streams: list[tuple[int, int, object]] = []  # (layer_start, layer_end, OutStream)
        self.kv_lock = threading.Lock()
        self.tables: dict[str, list[int]] = {}  # token role: request -> this pipeline's block ids

    # ------------------------------------------------------------------ set-up
    def run(self) -> None:
        cfg = self.cfg
        self.step_in = self.ctx.socket(zmq.PULL)
        port = self.step_in.bind_to_random_port(f"tcp://{cfg.host}")
        ctrl = self.ctx.socket(zmq.PUSH)
        ctrl.setsockopt(zmq.LINGER, 1000)
        ctrl.connect(cfg.controller_addr)
        kv_addr = ""
        if cfg.role == "token":
            from kvflow.streaming.transports.tcp import TcpReceiver

            self.kv_receiver = TcpReceiver(cfg.host)
            kv_addr = self.kv_receiver.address
            self.kv_thread = threading.Thread(target=self._receive_kv, name="kv-in", daemon=True)
            self.kv_thread.start()
        ctrl.send_multipart(encode(Ready(cfg.name, f"tcp://{cfg.host}:{port}", kv_addr)))
        wire, _ = decode(self.step_in.recv_multipart())
        if not isinstance(wire, Wire):
            raise RuntimeError(f"expected Wire first, got {type(wire).__name__}")
        self.out = self.ctx.socket(zmq.PUSH)
        self.out.setsockopt(zmq.LINGER, 1000)
        self.out.connect(wire.next_addr)
        if cfg.role == "prompt":
            from kvflow.streaming.primitives import OutStream
            from kvflow.streaming.transports.tcp import TcpSender

            for a, b, addr in wire.kv_peers:
                self.kv_streams.append((a, b, OutStream(TcpSender(addr), f"{cfg.name}->{a}:{b}")))
        threads = [threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)]
        threads[0].start()
        if cfg.role == "token":
            threads.append(self.kv_thread)
        try:
            self._loop(ctrl)
        finally:
            self.stop.set()
            for t in threads:
                t.join(2.0)
            self.ctx.destroy(linger=0)

    def _loop(self, ctrl) -> None:
        parent = os.getppid()
        while True:
            if not self.step_in.poll(1000):
                if os.getppid() != parent:  # the controller that spawned us is gone: do not linger
                    log.warning("controller process exited; worker %s stops", self.cfg.name)
                    return
                continue
            msg, tensor = decode(self.step_in.recv_multipart())
            if isinstance(msg, Step):
                try:
                    self._step(msg, tensor)
                except Exception as e:  # report, the controller fails the microbatch's requests
                    log.exception("step failed")
                    ctrl.send_multipart(encode(WorkerError(self.cfg.name, f"{type(e).__name__}: {e}")))
            elif isinstance(msg, Free):
                with self.kv_lock:
                    for rid in msg.rids:
                        self.tables.pop(rid, None)
            elif isinstance(msg, Shutdown):
                return

    # ------------------------------------------------------------------ compute
    def _step(self, msg: Step, hidden: torch.Tensor | None) -> None:
        t0 = time.perf_counter()
        slices, start = [], 0
        for s in msg.seqs:
            slices.append(SeqSlice(start, s.query_len, s.context_len, tuple(s.block_ids)))
            start += s.query_len
        batch = ForwardBatch.build(slices, self.cfg.block_size)
        if self.model.is_first:
            hidden = self.model.embed(torch.tensor(msg.token_ids, dtype=torch.long))
        hook = self._kv_hook(msg) if msg.kv_to and self.kv_streams else None
        hidden = self.model.run_layers(hidden, batch, self.cache, hook)
        if self.model.is_last:
            logits = self.model.logits(hidden, batch)
            dt = time.perf_counter() - t0
            self.out.send_multipart(encode(StepResult(msg.mb, msg.step, [s.rid for s in msg.seqs], dt), logits))
        else:
            msg.token_ids = []
            self.out.send_multipart(encode(msg, hidden))
        self.busy_s += time.perf_counter() - t0
        self.steps += 1

    def _kv_hook(self, msg: Step):
        """Layer-by-layer prompt streaming: right after layer l's KV is written, pack it for every
        request of the step and flush it to the token worker owning layer l (one chunk per layer)."""
        from kvflow.streaming.chunk import ChunkDesc, Segment
        from kvflow.streaming.primitives import flush
        from kvflow.streaming.region import KVRegion, SeqRegion, pack

        seqs = tuple(SeqRegion(s.rid, tuple(s.block_ids), 0, s.context_len) for s in msg.seqs if s.rid in msg.kv_to)
        dest_blocks = {s.rid: msg.kv_to[s.rid] for s in msg.seqs if s.rid in msg.kv_to}
        slots = KVRegion(seqs, 0, 1).slot_tensor(self.cfg.block_size)

        def hook(layer: int, batch) -> None:
            region = KVRegion(seqs, layer, layer + 1)
            data = pack(self.cache, region, slots)
            for a, b, out in self.kv_streams:
                if a <= layer < b:
                    desc = ChunkDesc(tuple(Segment(s.request_id, 0, s.token_end) for s in seqs), layer, layer + 1, "kv")
                    h = flush(out, desc, data, {"blocks": dest_blocks})
                    self.kv_sent += h.nbytes

        return hook

    # ------------------------------------------------------------------ token role: receiving KV
    # Destination block ids travel in each chunk's metadata (set by the controller in Step.kv_to),
    # so a chunk never waits for a separate control message to know where it goes.
    def _receive_kv(self) -> None:
        from kvflow.streaming.primitives import InStream, fetch
        from kvflow.streaming.scatter import KVSink

        inp = InStream(self.kv_receiver)
        sink = KVSink(self.cache, lambda rid, n: self.tables[rid])
        notify = self.ctx.socket(zmq.PUSH)
        notify.setsockopt(zmq.LINGER, 1000)
        notify.connect(self.cfg.controller_addr)
        lay = self.cache.layout
        while not self.stop.is_set():
            try:
                chunk = fetch(inp, timeout=0.2)
            except TimeoutError:
                continue
            except Exception as e:  # a rejected chunk: the sender is told through the ack; report too
                notify.send_multipart(encode(WorkerError(self.cfg.name, f"KV chunk rejected: {e}")))
                continue
            with chunk:
                done = []
                with self.kv_lock:
                    for seg in chunk.header.desc.segments:
                        if seg.request_id not in sink.expected:
                            self.tables[seg.request_id] = list(chunk.header.meta["blocks"][seg.request_id])
                            sink.expect(seg.request_id, lay.layer_start, lay.layer_end, 0, seg.token_end)
                    sink.write(chunk)
                    self.kv_received += chunk.header.nbytes
                    for seg in chunk.header.desc.segments:
                        if sink.complete_for([seg.request_id]):
                            done.append(seg.request_id)
                            sink.expected.pop(seg.request_id, None)
                            sink.received.pop(seg.request_id, None)
            if done:
                notify.send_multipart(encode(KVArrived(self.cfg.name, done)))
        notify.close(0)
        self.kv_receiver.close()

    # ------------------------------------------------------------------ liveness
    def _heartbeat(self) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.cfg.controller_addr)
        while not self.stop.wait(self.cfg.heartbeat_s):
            sock.send_multipart(encode(Heartbeat(self.cfg.name, self.busy_s, self.steps, self.kv_sent, self.kv_received)))
        sock.close(0)


def run_worker(cfg: WorkerConfig) -> None:
    logging.basicConfig(level=os.environ.get("KVFLOW_LOG", "WARNING"))
    Worker(cfg).run()
