"""Profiled performance model: linear fits of measured engine timings, saved as a JSON profile.

Fitted forms (whole model on one machine; Aladdin and Vidur report these shapes hold closely):
    prompt(b, s) = p0 + p1 * b*s + p2 * b*s^2        (weights GEMMs + causal attention)
    token(b, c)  = q0 + q1 * b   + q2 * b*c          (per-step overhead, weights, KV reads)
A stage of a depth-D pipeline pays the intercept and the weight terms (p1, q1) in proportion to the
parameters it holds (the last stage holds the LM head) and the attention terms (p2, q2) in
proportion to its layers. The intercept scales too: on a CPU it is mostly the time to stream the
weights once per step (a decode step of one sequence is memory-bound) and the per-layer Python
work, both split among the stages; charging every stage the whole intercept priced a depth-2
pipeline's steps far too slow. What a stage pays whatever its share — messages, codec, the
controller's share — is measured by `calibrate.executor_overhead` through worker pipelines of one
and two stages: per pass `pass_overhead_s + seq_overhead_s * sequences` (the controller's round
trip, charged to the last stage, whose result ends the pass), `prompt_overhead_s` more when the pass
prefills (measured as the time to first token minus the prompt pass's compute), and
`hop_overhead_s` for every further stage; 0 for a profile without them.
The engine's fits include the engine's own host-side work per step (scheduling, sampling,
outputs: `engine_host_s`, the median of step minus model forward over the decode samples); in a
worker pipeline that work is the controller's and is inside the pass overhead, so a worker
stage is priced without it (else it is counted twice; a small term: docs/results.md, 2026-11-24 fidelity).
`co_run` is how much slower prefill and decode steps run while another worker process of the same
host computes (`calibrate.co_run_slowdown`); the simulator applies it to stages that share a host.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from kvflow.perf.hardware import MachineSpec, machine
from kvflow.perf.model_shape import ModelShape
from kvflow.perf.perf_model import BatchShape, PerfModel, _check


@dataclass(frozen=True)
class Sample:
    """One measurement: `batch` sequences of `length` tokens (prompt length or decode context)."""

    batch: int
    length: int
    seconds: float


@dataclass(frozen=True)
class LinearFit:
    """Non-negative coefficients of `y = c0 + c1*f1 + c2*f2` and the fit's worst relative error."""

    coef: tuple[float, float, float]
    max_rel_error: float

    def __call__(self, f1: float, f2: float) -> float:
        return self.coef[0] + self.coef[1] * f1 + self.coef[2] * f2


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: drop the most negative column and refit until none is."""
    active = list(range(x.shape[1]))
    while True:
        sol = np.zeros(x.shape[1])
        if active:
            sol[active] = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        neg = [i for i in active if sol[i] < 0]
        if not neg:
            return sol
        active.remove(min(neg, key=lambda i: sol[i]))


def _fit(samples: list[Sample], feats) -> LinearFit:
    if len(samples) < 3:
        raise ValueError("a fit needs at least 3 samples")
    x = np.array([[1.0, *feats(s.batch, s.length)] for s in samples])
    y = np.array([s.seconds for s in samples])
    # Weight rows by 1/y so the fit minimises relative, not absolute, error.
    coef = nonneg_lstsq(x / y[:, None], np.ones_like(y))
    pred = x @ coef
    return LinearFit(tuple(float(c) for c in coef), float(np.max(np.abs(pred - y) / y)))


def prompt_features(b: int, s: int) -> tuple[float, float]:
    return b * s, b * s * s


def token_features(b: int, c: int) -> tuple[float, float]:
    return b, b * c


@dataclass(frozen=True)
class Profile:
    """Measured timings of the whole model on one machine, as written by `kvflow profile`."""

    shape: ModelShape
    machine: str
    prompt: tuple[Sample, ...]
    token: tuple[Sample, ...]
    meta: dict
    pass_overhead_s: float = 0.0  # worker pipelines: per pass (the controller's round trip), ...
    co_run: tuple[float, float] = (1.0, 1.0)  # (prefill, decode) slowdown beside a busy neighbour
    engine_host_s: float = 0.0  # of an engine step, what is not the model forward (a worker does not pay it)
    seq_overhead_s: float = 0.0  # ... plus this per sequence of the batch, ...
    hop_overhead_s: float = 0.0  # ... plus this per stage after the first
    prompt_overhead_s: float = 0.0  # ... plus this for a pass that prefills

    def save(self, path: str | Path) -> None:
        doc = {"shape": asdict(self.shape), "machine": self.machine, "meta": self.meta,
               "pass_overhead_s": self.pass_overhead_s, "co_run": list(self.co_run),
               "engine_host_s": self.engine_host_s, "seq_overhead_s": self.seq_overhead_s,
               "hop_overhead_s": self.hop_overhead_s, "prompt_overhead_s": self.prompt_overhead_s,
               "prompt": [asdict(s) for s in self.prompt], "token": [asdict(s) for s in self.token]}
        Path(path).write_text(json.dumps(doc, indent=1))

    def scaled(self, factor: float) -> "Profile":
        """The same machine running `factor` times slower (< 1: faster): every measured time scaled, the
        co-run slowdown (a ratio) kept. A shared VM's speed moves by this much between a calibration
        and a run minutes later; a fidelity check that measures the run's own compute time (its
        engines' busy seconds) prices the simulation at that speed."""
        if not factor > 0:
            raise ValueError(f"a speed factor must be > 0, got {factor}")
        def times(samples: tuple[Sample, ...]) -> tuple[Sample, ...]:
            return tuple(Sample(s.batch, s.length, s.seconds * factor) for s in samples)
        return replace(self, prompt=times(self.prompt), token=times(self.token),
                       pass_overhead_s=self.pass_overhead_s * factor, engine_host_s=self.engine_host_s * factor,
                       seq_overhead_s=self.seq_overhead_s * factor, hop_overhead_s=self.hop_overhead_s * factor,
                       prompt_overhead_s=self.prompt_overhead_s * factor)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        doc = json.loads(Path(path).read_text())
        return cls(ModelShape(**doc["shape"]), doc["machine"], tuple(Sample(**s) for s in doc["prompt"]),
                   tuple(Sample(**s) for s in doc["token"]), doc.get("meta", {}),
                   doc.get("pass_overhead_s", doc.get("stage_overhead_s", 0.0)),
                   tuple(doc.get("co_run", (1.0, 1.0))), doc.get("engine_host_s", 0.0), doc.get("seq_overhead_s", 0.0),
                   doc.get("hop_overhead_s", 0.0), doc.get("prompt_overhead_s", 0.0))


class ProfiledPerfModel(PerfModel):
    """PerfModel whose prompt and token times come from fits of a measured `Profile`."""

    def __init__(self, profile: Profile, machine_spec: MachineSpec | None = None, executor: bool = False) -> None:
        """`executor`: the batches run in worker processes even at depth 1 (pay the pass overhead)."""
        super().__init__(profile.shape, machine_spec or machine(profile.machine))
        self.profile = profile
        self.executor = executor
        self.prompt_fit = _fit(list(profile.prompt), prompt_features)
        self.token_fit = _fit(list(profile.token), token_features)

    @classmethod
    def from_json(cls, path: str | Path) -> "ProfiledPerfModel":
        return cls(Profile.load(path))

    def _shares(self, depth: int) -> tuple[float, float]:
        """(weight share, layer share) of the most loaded stage of a `depth`-stage pipeline."""
        sh = self.shape
        hi, lo = sh.layers_per_stage(depth), sh.layers // depth
        per_layer, head = sh.params_per_layer, sh.vocab * sh.hidden
        if depth == 1:
            return 1.0, 1.0
        weights = max(hi * per_layer, lo * per_layer + head) / (sh.layers * per_layer + head)
        return weights, hi / sh.layers

    def _stage_shares(self, depth: int, stage: int) -> tuple[float, float]:
        """(weight share, layer share) of stage `stage` (the controller's split; the LM head on the last)."""
        sh = self.shape
        if depth == 1:
            return 1.0, 1.0
        n, per_layer, head = sh.stage_layers(depth, stage), sh.params_per_layer, sh.vocab * sh.hidden
        return (n * per_layer + (head if stage == depth - 1 else 0)) / (sh.layers * per_layer + head), n / sh.layers

    def _overhead(self, batch: BatchShape, depth: int, stage: int) -> float:
        """What worker processes add to stage `stage`'s compute: each stage after the first its hop;
        the last stage (its result ends the pass) the pass's round trip, which grows with the batch,
        and more when the pass prefills."""
        if depth == 1 and not self.executor:
            return 0.0
        p = self.profile
        hop = p.hop_overhead_s if stage > 0 else 0.0
        if stage < depth - 1:
            return hop
        prompt = p.prompt_overhead_s if batch.prefill_seqs else 0.0
        return hop + p.pass_overhead_s + p.seq_overhead_s * (batch.prefill_seqs + batch.decode_seqs) + prompt

    def prompt_stage_time(self, batch: int, prompt_len: int, depth: int) -> float:
        _check(batch, prompt_len)
        return self.step_time(BatchShape(batch, batch * prompt_len, batch * prompt_len * prompt_len), depth)

    def token_stage_time(self, batch: int, context_len: int, depth: int) -> float:
        _check(batch, context_len)
        return self.step_time(BatchShape(decode_seqs=batch, decode_context=batch * context_len), depth)

    def step_time(self, batch: BatchShape, depth: int) -> float:
        """Exact features of a mixed or chunked batch: one step overhead (the larger intercept),
        p1 * prefill tokens + p2 * sum(new x context) for the prefill chunks, q1 * b + q2 * sum of
        contexts for the decodes, each scaled to the stage's share; plus the executor's overhead."""
        return self._priced(batch, depth, *self._shares(depth))

    uniform_stages = False

    def stage_step_time(self, batch: BatchShape, depth: int, stage: int) -> float:
        """`step_time` with stage `stage`'s own shares of the weights and layers: with the LM head on
        the last stage, a depth-2 pipeline's stages differ markedly on a small model, and a request's
        token passes both (its TPOT is their sum, not twice the slower)."""
        return self._priced(batch, depth, *self._stage_shares(depth, stage), stage=stage)

    def _priced(self, batch: BatchShape, depth: int, w: float, a: float, stage: int | None = None) -> float:
        """`stage` None: the most loaded stage (the last: it holds the LM head and ends the pass)."""
        if not batch.seqs:
            raise ValueError("an empty batch has no step time")
        p0, p1, p2 = self.prompt_fit.coef
        q0, q1, q2 = self.token_fit.coef
        c0 = max(p0 if batch.prefill_seqs else 0.0, q0 if batch.decode_seqs else 0.0)
        if depth > 1 or self.executor:  # a worker stage: the engine's host-side work is the controller's
            c0 = max(0.0, c0 - self.profile.engine_host_s)
        weights = c0 + p1 * batch.prefill_tokens + q1 * batch.decode_seqs
        attention = p2 * batch.prefill_attention + q2 * batch.decode_context
        return w * weights + a * attention + self._overhead(batch, depth, depth - 1 if stage is None else stage)

    def co_run_factor(self, batch: BatchShape) -> float:
        """The profile's slowdown beside a busy neighbour on the same host, prefill and decode
        factors weighted by the batch's prefill and decode work."""
        kp, kd = self.profile.co_run
        _, p1, p2 = self.prompt_fit.coef
        _, q1, q2 = self.token_fit.coef
        tp = p1 * batch.prefill_tokens + p2 * batch.prefill_attention
        td = q1 * batch.decode_seqs + q2 * batch.decode_context
        return (kp * tp + kd * td) / (tp + td) if tp + td > 0 else kd
