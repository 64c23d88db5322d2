"""How a pipeline-stage worker computes a step (`StageCompute`, the compute half of `Worker`): the
step's inputs prepared from its deltas (block tables mirrored, tier copies, attention metadata), the
forward over this stage's layers (a decode graph's replay where one fits), and its output sent on:
hidden states to the next stage, or from the last stage the argmax ids of its greedy rows and the
other rows' logits to the controller.

A pipeline of one stage whose decode graphs decode ahead (`DecodeGraphs.launch`) keeps the step it
launched last in flight (`LastSampled.flight`): a step that comes while it computes is launched
behind it, its `AHEAD` rows fed from the flight's argmax on the device, and only then is the flight
read back and sent. The worker's host work for a step (receiving, decoding and preparing the next,
encoding and sending the last) then runs while the device computes, as in the engine decoding ahead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch
import zmq

from kvflow.kv.tiers import TierPlan
from kvflow.model.batch import ForwardBatch
from kvflow.streaming.connector import HandoffRequest
from kvflow.streaming.errors import peer_gone
from kvflow.streaming.swapper import SwapSeq
from kvflow.streaming.topology import Transfer
from kvflow.wire import Step, StepResult, WorkerError, encode
from kvflow.model.cuda_graphs import Launch
from kvflow.worker.steps import AHEAD, Flight, Prepared

log = logging.getLogger(__name__)


class Landed:
    """Wakes a worker's loop when a flight's ids are on the host, so that the loop waits for the next
    step and for the device in one poll, the GIL released: a thread waits for each launch (its CUDA
    event) and rings an inproc socket (`sock`) the loop polls beside its step socket. A ring names its
    launch (`watch`'s ticket): a flight read back sooner, because a step came first, rings late.
    (A loop spinning on the event and the socket instead would hold the GIL, which the worker's
    replication and KV threads need.)"""

    def __init__(self, ctx: zmq.Context) -> None:
        self._addr = f"inproc://landed-{id(self)}"
        self.sock = ctx.socket(zmq.PAIR)
        self.sock.bind(self._addr)
        self._ctx, self._tickets = ctx, 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._wait, name="landed", daemon=True)
        self._thread.start()

    def watch(self, launch: Launch) -> int:
        self._tickets += 1
        self._queue.put((self._tickets, launch))
        return self._tickets

    def rung(self) -> int:
        """The latest ticket rung so far (0: none since the last call)."""
        last = 0
        while self.sock.poll(0):
            last = max(last, int.from_bytes(self.sock.recv(), "little"))
        return last

    def _wait(self) -> None:
        ring = self._ctx.socket(zmq.PAIR)  # (this thread's only)
        ring.connect(self._addr)
        try:
            while (item := self._queue.get()) is not None:
                ticket, launch = item
                launch.wait()
                ring.send(ticket.to_bytes(8, "little"))
        finally:
            ring.close(0)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5.0)
        self.sock.close(0)


class StageCompute:
    """The compute half of `Worker`; it reads the worker's state: the model, caches and graphs
    (`stage.build`), the mirrored block tables, `last` (decode-ahead inputs), the KV sender,
    replicator and swapper, the hidden-state rings and the output sockets."""

    _landed_at = 0.0  # when the last flight was read back (busy time is counted once where flights overlap)
    landed: Landed | None = None  # (graphs decoding ahead) rings when a flight's ids are on the host

    def _run(self, msg: Step, tensor, prep) -> None:
        try:
            if isinstance(prep, Exception):
                raise prep
            self._step(msg, tensor, prep if prep is not None else self._prepare(msg))
        except Exception as e:  # report; the controller recovers or fails the batch's requests
            log.exception("step failed")
            self._to_controller(WorkerError(self.name, f"{type(e).__name__}: {e}", msg.epoch, peer_gone=peer_gone(e)))
        finally:
            if self.swapper is not None:
                self.swapper.done((msg.epoch, msg.batch))

    def _prepare(self, msg: Step) -> "Prepared":
        """In step order: the copies between KV tiers (a rejected disk block travels on to the
        controller), the mirrored block tables updated from the step's deltas, the batch's attention
        metadata (over the device region's blocks when swapping) and what to swap in and back."""
        if msg.tier_ops:
            msg.tier_failed = sorted(set(msg.tier_failed) | set(self.tiers.apply(TierPlan.from_wire(msg.tier_ops))))
        for rid in msg.free:  # (a token worker's KV receiver forgets a request by itself once its KV is in)
            self.tables.pop(rid, None)
        self.last.forget(msg.free)
        seqs, tables, swap = [], {}, []
        for s in msg.seqs:
            if s.full_table:
                self.tables[s.rid] = list(s.new_blocks)
            else:
                self.tables.setdefault(s.rid, []).extend(s.new_blocks)
            tables[s.rid] = table = tuple(self.tables[s.rid])
            if msg.swap_region >= 0:
                swap.append(SwapSeq(s.rid, table, tuple(s.device_blocks), s.start, s.context_len))
            seqs.append((s.num_new, s.context_len, s.device_blocks if swap else table))
        if (self.graphs is not None and 0 < len(seqs) <= self.graphs.max_batch and all(n == 1 for n, _, _ in seqs)
                and not (self.sender is not None and msg.kv_plan)):  # (streaming KV out needs its layer hook)
            return Prepared(None, tables, swap, [(ctx, blocks) for _, ctx, blocks in seqs])
        batch = ForwardBatch.of(seqs, self.cache.layout.block_size, self.device) if seqs else None
        return Prepared(batch, tables, swap)

    def _step(self, msg: Step, hidden: torch.Tensor | None, prep: "Prepared") -> None:
        t0 = time.perf_counter()
        if self._launch(msg, prep, t0):
            return
        if self.last.flight is not None:  # (a step that cannot go behind it: read it back first)
            self._land()
            t0 = time.perf_counter()
        if not msg.seqs:  # tier copies only
            self._forward(msg, None, t0)
            return
        batch = prep.batch
        if prep.swap:
            self.swapper.wait((msg.epoch, msg.batch))  # its KV is in the device region
        if self.model.is_first:
            if AHEAD in msg.token_ids:
                self.last.fill(msg)
            hidden = None if prep.graphed else self.model.embed(torch.tensor(msg.token_ids, dtype=torch.long, device=self.device))
        else:
            if msg.hidden:  # (in the ring, not a frame)
                if self.hidden_in is None:
                    raise ValueError(f"{self.name}: a step names a hidden-state ring this stage has not mapped")
                hidden = self.hidden_in.get(msg.hidden)
            hidden = hidden.to(self.device, self.engine_cfg.torch_dtype)
        hook = None
        if self.sender is not None and msg.kv_plan:
            reqs = [HandoffRequest(k.rid, k.token_start, k.token_end, k.total, prep.tables[k.rid], tuple(k.dest_blocks),
                                   k.dest_start) for k in msg.kv_out]
            self.sender.begin(reqs, [Transfer(*t) for t in msg.kv_plan], msg.epoch)
            hook = self.sender.on_layer if self.sender.active else None
        if prep.graphed:
            out = self.graphs.run(prep.graphed, tokens=msg.token_ids if hidden is None else None, hidden=hidden)
        else:
            out = self.model.run_layers(hidden, batch, self.compute_cache, hook)
            if self.model.is_last:
                out = self.model.logits(out, batch, as_float=False)  # (the model's dtype: half the bytes in bf16)
        if prep.swap:
            self.swapper.write_back(prep.swap)  # only what this step appended
        self._forward(msg, out, t0)
        if self.replicator is not None:  # after the output left: while the controller takes it in
            self.replicator.step(msg, prep.tables)
        self.busy_s += time.perf_counter() - t0
        self.steps += 1

    def _launch(self, msg: Step, prep: Prepared, t0: float) -> bool:
        """(one stage, graphs decoding ahead) Launch `msg` on the device, its `AHEAD` rows fed from the
        flight's argmax there, and read the flight back after: False (nothing done) unless every row
        is a plain argmax of one decode graph step and every `AHEAD` can be fed."""
        g = self.graphs
        if g is None or not g.ahead or not prep.graphed or prep.swap or len(msg.argmax_rows) != len(msg.seqs):
            return False
        sources = self.last.sources(msg)
        if sources is None:
            return False
        prev = self.last.flight
        launch = g.launch(prep.graphed, msg.token_ids, sources if prev is not None else None)
        self.last.flight = Flight(msg, prep.tables, launch, {s.rid: i for i, s in enumerate(msg.seqs)}, t0,
                                  self.landed.watch(launch) if self.landed is not None else 0)
        self.launched_ahead += prev is not None
        if prev is not None:
            self._land(prev)
        return True

    def _land(self, flight: Flight | None = None) -> None:
        """Read a launched step's ids back and send its result (the flight, unless `flight` names the one before)."""
        f = flight or self.last.flight
        if f is self.last.flight:
            self.last.flight = None
        t0 = max(f.t0, self._landed_at)  # (its time from the read before: flights overlap, counted once)
        try:
            ids = f.launch.read()
            rows = list(range(len(ids)))
            self.last.record(f.msg, rows, ids, self.tables)
            self._result(f.msg, rows, ids, None, t0)
            if self.replicator is not None:
                self.replicator.step(f.msg, f.tables)
        except Exception as e:
            log.exception("step failed")
            self._to_controller(WorkerError(self.name, f"{type(e).__name__}: {e}", f.msg.epoch, peer_gone=peer_gone(e)))
        self._landed_at = time.perf_counter()
        self.busy_s += self._landed_at - t0
        self.steps += 1

    def _forward(self, msg: Step, out: torch.Tensor | None, t0: float) -> None:
        """The step's output (None for a step of tier copies only): its hidden states to the next stage,
        or (last stage) its logits to the controller."""
        if self.model.is_last:
            rows, ids = (msg.argmax_rows if out is not None else []), []
            if rows:  # greedy rows: their argmax here, so that only the ids leave the device
                ids, skip = out[rows].argmax(-1).tolist(), set(rows)
                out = out[[i for i in range(out.shape[0]) if i not in skip]]
            if self.model.is_first:  # (one stage: the ids a decode-ahead step of this worker takes in)
                self.last.record(msg, rows, ids)
            self._result(msg, rows, ids, out, t0)
        else:
            msg.token_ids = []
            msg.hidden = self.hidden_out.put(out) or [] if self.hidden_out is not None and out is not None else []
            msg.busy_s += time.perf_counter() - t0  # the pipeline's compute so far, for the controller's step log
            self.out.send_multipart(encode(msg, self.secret, None if msg.hidden else out))

    def _result(self, msg: Step, rows: list[int], ids: list[int], out: torch.Tensor | None, t0: float) -> None:
        """(last stage) The step's result: the argmax `ids` of its `rows`, the other rows' logits `out`."""
        seqs = msg.seqs
        res = StepResult(msg.epoch, msg.batch, [s.rid for s in seqs], msg.busy_s + time.perf_counter() - t0, msg.tier_failed,
                         rows, ids, [seqs[i].context_len for i in rows] if self.ids_out is not None and rows else [])
        frames = encode(res, self.secret, out if out is not None else torch.empty(0))
        if res.positions:  # decoding ahead: the ids to stage 0 as well, first: its next step waits for them
            self.ids_out.send_multipart(frames)
        self.out.send_multipart(frames)

