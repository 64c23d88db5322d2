"""The batched sampler: a step's last-token logits to next tokens, each row with its request's parameters."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvflow.sched.request import Request
    from kvflow.sched.sampling import SamplingParams

TOP_P_CANDIDATES = 1024  # a top-p row's nucleus is looked for among its this many likeliest tokens first


def sample_requests(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """Next token of each request from its row of `logits` [len(requests), V], with its own parameters,
    random state, token history (penalties) and banned ids (stop/EOS ids before min_tokens).

    The whole batch goes through a few tensor operations, each row's result a function of that row
    alone (its logits, parameters, history and random draw), never of the batch around it:
    every operation used is either elementwise or a reduction along one row (softmax, cumsum,
    top-k, sort, argmax), which PyTorch's CPU kernels compute row by row in the same order whatever
    the number of rows, and a row takes the same path (masks, top-p candidates or full sort)
    whatever its neighbours ask for. So a request's output is the same alone or in any batch —
    the batch invariance kvflow keeps across failures (tests/test_sampling.py checks it bit for bit).

    Drawing: inverse transform sampling, one uniform number u per sampled row per step: the token is
    the first whose cumulative probability exceeds u times the row's total mass. A seeded request
    draws its u from its own `torch.Generator` (one draw per token, so the request replays
    identically whatever else runs); the unseeded rows share one draw from the global generator. A
    race of exponential or Gumbel noise over the vocabulary (`torch.multinomial`'s way) would need
    V random numbers per row, and drawing them is what made the per-request sampler slow (CPU
    random number generation costs more per element than the softmax and the cumulative sum
    together); one number per row makes the draw free. A token of probability 0 (banned, or
    filtered out) is never produced: the cumulative sum does not grow over it and the search asks for
    a strict excess. Greedy rows are an exact argmax of their (penalized, banned-masked) logits."""
    assert logits.dim() == 2 and logits.shape[0] == len(requests)
    n, vocab = logits.shape
    if n == 0:
        return []
    if logits.device.type != "cpu":
        return _device_first(logits, requests)
    params = [r.params for r in requests]
    x = logits.float()
    banned = [(i, t) for i, r in enumerate(requests) for t in r.banned_token_ids() if t < vocab]
    penalized = [i for i, p in enumerate(params) if p.penalized]
    if (banned or penalized) and x.data_ptr() == logits.data_ptr():
        x = x.clone()  # edited in place below; the caller's logits stay as they were
    if banned:
        rows, cols = zip(*banned)
        x[list(rows), list(cols)] = float("-inf")
    if penalized:
        _penalize(x, penalized, [requests[i] for i in penalized])
    out = [0] * n
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        picked = (x if len(greedy) == n else x[greedy]).argmax(dim=-1).tolist()
        for i, t in zip(greedy, picked):
            out[i] = t
    rows_s = [i for i, p in enumerate(params) if not p.greedy]
    if rows_s:
        for i, t in zip(rows_s, _sample_rows(x if len(rows_s) == n else x[rows_s], [params[i] for i in rows_s],
                                             [requests[i].sampler.generator for i in rows_s])):
            out[i] = t
    return out


def argmax_only(r: Request) -> bool:
    """Whether `r`'s next token is the plain argmax of its logits: greedy, no penalty, no id banned now
    (such a token can be taken wherever the logits are, and only the id moved)."""
    return r.params.greedy and not r.params.penalized and not r.banned_token_ids()


def _device_first(logits: torch.Tensor, requests: Sequence[Request]) -> list[int]:
    """Logits on an accelerator: a plain greedy row (no penalty, no banned id) is an exact argmax, taken
    there so that only its id crosses to the host; every other row is copied over and sampled as above
    (the same values either way: the host's argmax and the device's both return the first maximum)."""
    n = len(requests)
    plain, rest = [], []
    for i, r in enumerate(requests):
        (plain if argmax_only(r) else rest).append(i)
    out = [0] * n
    if plain:
        for i, t in zip(plain, (logits if len(plain) == n else logits[plain]).argmax(dim=-1).tolist()):
            out[i] = t
    if rest:
        for i, t in zip(rest, sample_requests(logits[rest].cpu(), [requests[i] for i in rest])):
            out[i] = t
    return out


def _penalize(x: torch.Tensor, rows: list[int], reqs: list[Request]) -> None:
    """Repetition, frequency and presence penalties on `x[rows]` in place (vLLM's order and definitions:
    repetition over prompt + output tokens, frequency and presence over generated tokens)."""
    vocab = x.shape[1]
    counts = torch.zeros(len(rows), vocab + 1)  # column `vocab`: padding
    seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool)
    outs = [torch.tensor(r.output_token_ids, dtype=torch.long) for r in reqs]
    if any(len(o) for o in outs):
        ids = torch.nn.utils.rnn.pad_sequence(outs, batch_first=True, padding_value=vocab).clamp_(max=vocab)
        counts.scatter_add_(1, ids, torch.ones(ids.shape))
    rep = [k for k, r in enumerate(reqs) if r.params.repetition_penalty != 1.0]
    if rep:
        prompts = torch.nn.utils.rnn.pad_sequence([torch.tensor(reqs[k].prompt_token_ids, dtype=torch.long) for k in rep],
                                                  batch_first=True, padding_value=vocab).clamp_(max=vocab)
        seen[rep] = seen[rep].scatter_(1, prompts, True)
    counts, seen = counts[:, :vocab], seen[:, :vocab] | (counts[:, :vocab] > 0)
    col = lambda name: torch.tensor([getattr(r.params, name) for r in reqs], dtype=torch.float32).unsqueeze(1)  # noqa: E731
    xp = x[rows]
    rp = col("repetition_penalty")
    xp = torch.where(seen, torch.where(xp > 0, xp / rp, xp * rp), xp)
    xp -= col("frequency_penalty") * counts + col("presence_penalty") * (counts > 0)
    x[rows] = xp


def _sample_rows(x: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator | None]) -> list[int]:
    """One token per row of `x` [S, V] (penalized and banned logits), every row sampled (temperature > 0).
    A filter's mask is applied to every row at once with a per-row threshold (-inf: the row has no such
    filter, and nothing is below it), so no row's logits are copied out and back."""
    s, vocab = x.shape
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32).unsqueeze(1)
    x = x / temps  # a new tensor: the masks below edit it in place
    if any(p.min_p > 0.0 for p in params):
        floor = torch.tensor([math.log(p.min_p) if p.min_p > 0.0 else -math.inf for p in params], dtype=torch.float32)
        x.masked_fill_(x < (x.amax(dim=-1) + floor).unsqueeze(1), -math.inf)
    topk = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if topk:
        ks = torch.tensor([params[i].top_k for i in topk])
        kth = torch.full((s, 1), -math.inf)
        kth[topk] = (x if len(topk) == s else x[topk]).topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
        x.masked_fill_(x < kth, -math.inf)
    probs = torch.softmax(x, dim=-1)
    u = _uniforms(gens)
    out = [0] * s
    plain = [i for i, p in enumerate(params) if p.top_p >= 1.0]
    if plain:
        for i, t in zip(plain, _invert(probs if len(plain) == s else probs[plain], u[plain])):
            out[i] = t
    groups: dict[int, list[int]] = {}  # top-p rows by how many candidates they look at first
    for i, p in enumerate(params):
        if p.top_p < 1.0:
            groups.setdefault(min(p.top_k if 0 < p.top_k < TOP_P_CANDIDATES else TOP_P_CANDIDATES, vocab), []).append(i)
    for k, rows in groups.items():
        tops = torch.tensor([params[i].top_p for i in rows], dtype=torch.float32)
        for i, t in zip(rows, _nucleus(probs[rows], k, tops, u[rows])):
            out[i] = t
    return out


def _uniforms(gens: list[torch.Generator | None]) -> torch.Tensor:
    """One U[0, 1) number (float64) per row: a seeded row's from its own generator, the others' from one draw."""
    u = torch.empty(len(gens), dtype=torch.float64)
    free = [i for i, g in enumerate(gens) if g is None]
    if free:
        u[free] = torch.rand(len(free), dtype=torch.float64)
    for i, g in enumerate(gens):
        if g is not None:
            u[i] = torch.rand((), dtype=torch.float64, generator=g)
    return u


def _invert(probs: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Inverse transform in vocabulary order: the first token whose cumulative probability exceeds u * total."""
    cum = probs.cumsum(dim=-1)
    target = (u * cum[:, -1].double()).float().unsqueeze(1)
    idx = torch.searchsorted(cum, target, right=True).squeeze(1)
    # u * total can round up to the total itself: take the last token with mass (never a zero-probability one)
    out = idx.tolist()
    for r, j in enumerate(out):
        if j >= probs.shape[1]:
            out[r] = int(torch.nonzero(probs[r]).max())
    return out


def _nucleus(probs: torch.Tensor, k: int, top_p: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Top-p rows: the likeliest tokens in descending order (ties in the order `topk`/`sort` give them), the
    smallest prefix whose mass reaches top_p kept (always at least one token), the draw inverted over it.
    Sorting a whole row costs ten times a `topk` of a thousand, and the nucleus is nearly always far
    smaller, so each row looks among its `k` likeliest tokens first (its top_k, or `TOP_P_CANDIDATES`:
    a function of the row's own parameters, so its path never depends on the batch) and sorts the
    whole vocabulary only when those do not reach top_p."""
    vals, idx = probs.topk(k, dim=-1)
    cum = vals.cumsum(dim=-1)
    short = (cum[:, -1] < top_p).nonzero().flatten().tolist()
    out = _prefix_draw(vals, idx, cum, top_p, u)
    if short:
        sv, si = probs[short].sort(dim=-1, descending=True)
        for r, t in zip(short, _prefix_draw(sv, si, sv.cumsum(dim=-1), top_p[short], u[short])):
            out[r] = t
    return out


def _prefix_draw(vals: torch.Tensor, idx: torch.Tensor, cum: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Rows of probabilities sorted in descending order (`vals`, token ids `idx`, running sums `cum`): keep
    each row's tokens before its running sum reaches top_p and with mass > 0, draw by inverse transform."""
    keep = ((cum - vals) < top_p.unsqueeze(1)) & (vals > 0)
    last = (keep.sum(dim=-1) - 1).clamp_(min=0).unsqueeze(1)  # a prefix: the running sum only grows
    target = (u * cum.gather(1, last).squeeze(1).double()).float().unsqueeze(1)
    j = torch.minimum(torch.searchsorted(cum, target, right=True), last)
    return idx.gather(1, j).squeeze(1).tolist()
