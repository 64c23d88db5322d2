"""Replication and recovery in the controller: the replication watermarks that worker messages
advance, and the protocol that replaces a lost worker and brings its KV back. What happens to the
requests afterwards is the executor's recovery policy (`PipelineExecutor.recover`); this module
decides only how much KV survived (`resume`) and carries out the process-level steps."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from kvflow.controller.pipeline import Pipeline, StageHandle
from kvflow.controller.workers import StartError
from kvflow.wire import Fence, KVArrived, Restore, StepResult, WorkerError

if TYPE_CHECKING:
    from kvflow.controller.controller import Controller

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RecoveryRecord:
    """One completed recovery: when the loss was detected (time.monotonic()), how long starting the
    replacement (spawn, load, handshake) and restoring its KV from the replica took, the total, and
    how many requests resumed (0: recomputed). The measured costs the simulator's failure model takes."""

    worker: str
    detected_at: float
    replace_s: float
    restore_s: float
    total_s: float
    resumed: int


class Recovery:
    """The recovery protocol of one controller, and its counters."""

    def __init__(self, ctrl: "Controller") -> None:
        self.ctrl = ctrl
        self.failures = 0
        self.recoveries = 0
        self.recovery_seconds = 0.0
        self.log: list[RecoveryRecord] = []  # one per completed recovery, in order
        self.recovering: str | None = None  # what is being recovered from (None: nothing)
        self.resumed = 0  # requests brought back from a replica (not recomputed from scratch)
        self.lost_tokens = 0  # KV tokens the failed pipelines had computed (all recomputed without a replica)
        self.recomputed_tokens = 0  # of those, the tokens that had to be computed again
        self._restoring: tuple[str, set[str]] | None = None  # (replacement, requests whose KV it still awaits)

    # --- replication watermarks ----------------------------------------------------------------

    def replicated(self, p: Pipeline, stage: int, rids: list[str], spans: list[tuple[int, int]]) -> None:
        """Stage `stage`'s replica received tokens [a, b) of these requests."""
        wm = p.watermark.setdefault(stage, {})
        for rid, (a, b) in zip(rids, spans):
            if rid in self.ctrl.reqs and a <= wm.get(rid, 0):  # contiguous from token 0
                wm[rid] = max(wm.get(rid, 0), b)

    def store_events(self) -> None:
        store = self.ctrl.store
        while store is not None and store.events:
            name, stage, rids, spans = store.events.popleft()
            self.replicated(next(p for p in self.ctrl.pipelines if p.name == name), stage, rids, spans)

    @staticmethod
    def forget(p: Pipeline, rids) -> None:
        """No replica holds these requests' KV any more (recomputed in new blocks, or freed)."""
        for wm in p.watermark.values():
            for rid in rids:
                wm.pop(rid, None)

    def lag(self) -> int:
        """Max over replicating pipelines' stages and running requests of progress - watermark
        (read from the event loop while the loop thread updates it: a best-effort gauge)."""
        lag = 0
        try:
            for p in self.ctrl.pipelines:
                if not self.ctrl.cfg.replicates(p.spec):
                    continue
                running = [(r.request_id, r.num_computed_tokens) for r in list(p.sched.running)]
                for st in range(p.depth):
                    wm = p.watermark.get(st, {})
                    lag = max([lag] + [n - wm.get(rid, 0) for rid, n in running])
        except RuntimeError:  # a dict changed size while read
            pass
        return lag

    def kv_arrived(self, msg: KVArrived) -> bool:
        """True if `msg` reports KV a restore is waiting for (then it is not a hand-off's)."""
        if self._restoring is None or msg.name != self._restoring[0]:
            return False
        self._restoring[1].difference_update(msg.rids)
        return True

    # --- recovery ------------------------------------------------------------------------------

    def recover(self, lost: StageHandle, message: str) -> bool:
        """Fence the lost worker, start a replacement, bring the requests back; False if no
        replacement came up (the caller fails the requests).

        A new epoch voids whatever is still on the wire. If the lost stage's pipeline replicates and
        the stage holding its replica (x+1 mod depth) is alive, its requests resume: the holder sends
        the replica back into the replacement's cache, the previous stage (x-1) refills the replica
        the replacement holds, and each request continues from min(its progress, the replication
        watermark). Otherwise they are recomputed. While this runs, new requests queue."""
        ctrl, cfg, workers = self.ctrl, self.ctrl.cfg, self.ctrl.workers
        t0 = time.monotonic()
        log.warning("%s; recovering (epoch %d -> %d)", message, ctrl.epoch, ctrl.epoch + 1)
        self.recovering = message
        ctrl.epoch += 1
        lp = workers.pipeline_of(lost)
        holder = lp.stages[(lost.stage + 1) % lp.depth]
        prev = lp.stages[(lost.stage - 1) % lp.depth]
        resume = None
        mode = cfg.replicates(lp.spec)
        if mode == "store" or (mode == "ring" and holder.alive and prev.alive):
            wm = lp.watermark.get(lost.stage, {})
            resume = {r.request_id: min(r.num_computed_tokens, wm.get(r.request_id, 0)) for r in lp.sched.running
                      if not r.is_finished}
        for attempt in range(1, cfg.max_restarts + 1):
            workers.fence(lost)
            for s in workers.stages.values():
                if s is not lost and s.name in workers.to_stage:
                    workers.send(s.name, Fence(ctrl.epoch))
            if ctrl.store is not None:
                ctrl.store.fence(ctrl.epoch)
            workers.launch(lost)
            try:
                workers.handshake({lost.name}, ctrl.epoch, ctrl.handle)
                break
            except StartError as e:
                log.error("replacing %s failed (attempt %d of %d): %s", lost.name, attempt, cfg.max_restarts, e)
        else:
            self.recovering = None
            return False
        workers.wire(ctrl.token)
        lost.alive = True
        t_replaced = time.monotonic()
        if resume is not None and not self._restore(lp, lost, holder, prev, resume):
            resume = None
        t_restored = time.monotonic()
        computed = {r.request_id: r.num_computed_tokens for r in lp.sched.running if not r.is_finished}
        self.lost_tokens += sum(computed.values())
        self.recomputed_tokens += sum(n - (resume or {}).get(rid, 0) for rid, n in computed.items())
        cost = ctrl.executor.recover(lp, resume)
        for p in ctrl.pipelines:  # what is recomputed gets new KV, replicated anew
            self.forget(p, [r.request_id for r in cost.recompute])
        ctrl.forget_finished()
        now = time.monotonic()
        for s in workers.stages.values():
            s.last_heartbeat = now
        self.recovering = None
        self.recoveries += 1
        self.recovery_seconds += now - t0
        self.log.append(RecoveryRecord(lost.name, t0, t_replaced - t0, t_restored - t_replaced, now - t0,
                                       len(resume) if resume is not None else 0))
        how = f"{len(resume)} request(s) resumed from the replica" if resume is not None else "requests recomputed"
        log.warning("recovered from the loss of %s in %.2fs (%s)", lost.name, now - t0, how)
        return True

    def _restore(self, p: Pipeline, new: StageHandle, holder: StageHandle, prev: StageHandle, resume: dict[str, int]) -> bool:
        """Replica -> the replacement's cache, and (ring) the previous stage's KV -> the replica the
        replacement holds; waits until both are in. False (then the caller recomputes) on failure."""
        ctrl, workers = self.ctrl, self.ctrl.workers
        tables = {r.request_id: list(r.block_ids) for r in p.sched.running}
        back = [[rid, n, tables[rid]] for rid, n in resume.items() if n > 0]
        ring = ctrl.cfg.replicates(p.spec) == "ring"
        if ring:
            p.watermark[prev.stage] = {}  # the replica of prev was on the lost worker (the others are intact)
        if not back:
            return True
        self._restoring = (new.name, {rid for rid, _, _ in back})
        if ring:
            workers.send(holder.name, Restore(ctrl.epoch, "replica", new.kv_addr, new.stage, back))
            workers.send(prev.name, Restore(ctrl.epoch, "main", new.replica_addr, prev.stage, back))
        else:
            try:
                ctrl.store.restore(p.name, new.stage, back, new.kv_addr, ctrl.epoch)
            except Exception as e:
                log.error("restoring %s from the host store failed: %s; recomputing instead", new.name, e)
                self._restoring = None
                return False
        want = {rid: n for rid, n, _ in back} if ring else {}
        deadline = time.monotonic() + ctrl.cfg.start_timeout_s
        try:
            while self._restoring[1] or any(p.watermark[prev.stage].get(r, 0) < n for r, n in want.items()):
                if time.monotonic() > deadline or not workers.running(holder, prev, new):
                    log.error("restoring %s from its replica failed; recomputing instead", new.name)
                    return False
                got = workers.receive(50)
                if got is not None and got[0] is not None:
                    msg, tensor = got
                    if isinstance(msg, WorkerError) and msg.epoch == ctrl.epoch:
                        log.error("restoring %s failed: %s: %s; recomputing instead", new.name, msg.name, msg.message)
                        return False
                    if not isinstance(msg, (StepResult, WorkerError)):
                        ctrl.handle(msg, tensor)
                self.store_events()
            self.resumed += len(resume)
            return True
        finally:
            self._restoring = None
