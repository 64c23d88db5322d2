"""The batched sampler: distributions, exact filters, penalties, banned ids, greedy, seeds and batch invariance."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from kvflow.sched.admission import InvalidRequest
from kvflow.sched.request import Request
from kvflow.sched.sampler import TOP_P_CANDIDATES, sample_requests
from kvflow.sched.sampling import SamplingParams

EOS = 2


def req(params: SamplingParams, prompt: list[int] | None = None, output: list[int] = (), rid: str = "r") -> Request:
    r = Request(rid, list(prompt or [7, 8, 9]), params, eos_token_ids=(EOS,))
    r.output_token_ids.extend(output)
    return r


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0, chunk: int = 2000) -> torch.Tensor:
    """`n` tokens sampled from one row of logits, as `n` unseeded rows of batches (the global generator seeded)."""
    torch.manual_seed(seed)
    out = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        out += sample_requests(logits.expand(m, -1), [req(params) for _ in range(m)])
    return torch.tensor(out)


def chi2_critical(df: int, z: float = 3.72) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z 3.72: the 1e-4 upper tail."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_distribution(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """Pearson's chi-square test of the samples against `probs` over the tokens with probability > 0; none
    of probability 0 may appear at all. Deterministic for a fixed seed, so never flaky."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"tokens of probability 0 drawn: {torch.nonzero(counts * ~support).flatten().tolist()}"
    expected = probs[support].double() * len(samples)
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} over {df} degrees of freedom"


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The filtered distribution, written out in float64 from the definitions in SamplingParams' docstring."""
    x = logits.double() / p.temperature
    if p.min_p > 0:
        pr = torch.softmax(x, -1)
        x = x.masked_fill(pr < p.min_p * pr.max(), -math.inf)
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], -math.inf)
    pr = torch.softmax(x, -1)
    if p.top_p < 1:
        sp, idx = torch.sort(pr, descending=True)
        sp = sp.masked_fill(torch.cumsum(sp, -1) - sp >= p.top_p, 0.0)
        pr = torch.zeros_like(pr).scatter_(0, idx, sp)
    return pr / pr.sum()


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=2.5, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=1.3, top_k=6, top_p=0.9, min_p=0.05),
], ids=["t1", "t0.6", "t2.5-k5", "p0.8", "minp0.1", "all"])
def test_samples_follow_the_filtered_distribution(params):
    assert_distribution(draws(LOGITS, params, 20_000), reference(LOGITS, params))


def test_filters_keep_exactly_their_tokens():
    # probabilities 0.5, 0.3, 0.15, 0.05: each filter's kept set, ties of top_k kept too
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    support = lambda p: set(draws(logits, p, 4000).tolist())  # noqa: E731
    assert support(SamplingParams(top_p=0.4)) == {0}
    assert support(SamplingParams(top_p=0.75)) == {0, 1}
    assert support(SamplingParams(top_p=0.81)) == {0, 1, 2}
    assert support(SamplingParams(min_p=0.5)) == {0, 1}
    assert support(SamplingParams(min_p=0.25)) == {0, 1, 2}
    assert support(SamplingParams(min_p=0.09)) == {0, 1, 2, 3}
    assert support(SamplingParams(top_k=1, temperature=50)) == {0}
    assert support(SamplingParams(top_k=3, temperature=50)) == {0, 1, 2}
    tied = torch.tensor([5.0, 3.0, 3.0, 1.0, 0.0])
    assert set(draws(tied, SamplingParams(top_k=2, temperature=10), 2000).tolist()) == {0, 1, 2}


def test_a_nucleus_beyond_the_candidates_sorts_the_whole_row():
    # one token of mass 0.5 and 3000 light ones of distinct logits: top_p 0.9 keeps about 2400 of them,
    # more than the TOP_P_CANDIDATES looked at first, so the row takes the full sort
    light = 3000
    assert light * 0.8 > TOP_P_CANDIDATES
    rest = torch.linspace(0.0, -1.0, light)
    logits = torch.cat([torch.tensor([math.log(rest.exp().sum())]), rest])
    p = SamplingParams(top_p=0.9)
    ref = reference(logits, p)
    assert (ref > 0).sum() > TOP_P_CANDIDATES
    samples = draws(logits, p, 6000, chunk=500)
    assert (torch.bincount(samples, minlength=logits.numel())[ref == 0].sum()) == 0
    assert abs(float((samples == 0).double().mean()) - float(ref[0])) < 0.03  # 0.5 / 0.9 renormalized


def test_greedy_rows_are_the_argmax_whatever_shares_the_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(12, 5000, generator=g) * 4
    greedy = SamplingParams(temperature=0)
    mixed = [greedy if i % 3 == 0 else SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=i) for i in range(12)]
    out = sample_requests(logits, [req(p) for p in mixed])
    assert [out[i] for i in range(0, 12, 3)] == logits[::3].argmax(-1).tolist()
    assert sample_requests(logits, [req(greedy) for _ in range(12)]) == logits.argmax(-1).tolist()


def test_logits_on_an_accelerator_give_the_hosts_tokens():
    """Where the logits sit on a GPU, plain greedy rows take their argmax there and the others are
    sampled on the host (`_device_first`, run here on CPU tensors): the same tokens as the host path
    for a batch of every kind of row, seeded rows drawing the same numbers."""
    from kvflow.sched.sampler import _device_first

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 300, generator=g) * 3
    kinds = [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.5),
             SamplingParams(temperature=0, min_tokens=5, stop_token_ids=(int(logits[2].argmax()),)),
             SamplingParams(temperature=0.8, top_p=0.9, seed=5), SamplingParams(temperature=0)]
    batch = [kinds[i % len(kinds)] for i in range(8)]

    def run(sampler):
        reqs = [req(p, output=[1, 4], rid=f"r{i}") for i, p in enumerate(batch)]
        return sampler(logits, reqs)

    assert run(_device_first) == run(sample_requests)
    only_plain = [req(SamplingParams(temperature=0), rid=f"g{i}") for i in range(8)]
    assert _device_first(logits, only_plain) == logits.argmax(-1).tolist()


def test_the_callers_logits_are_left_as_they_were():
    logits = torch.randn(3, 100)
    before = logits.clone()
    params = SamplingParams(temperature=0.8, repetition_penalty=1.3, min_tokens=2, stop_token_ids=(5,), top_k=10, min_p=0.1)
    sample_requests(logits, [req(params, output=[1, 1]), req(SamplingParams(temperature=0, min_tokens=1)), req(params)])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(11,)),
    SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=(11,)),
    SamplingParams(temperature=0.5, top_k=3, min_tokens=3, stop_token_ids=(11,)),
    SamplingParams(temperature=1.0, top_p=0.99, min_tokens=3, stop_token_ids=(11,)),
    SamplingParams(temperature=2.0, min_p=0.5, min_tokens=3, stop_token_ids=(11,), seed=4),
])
def test_banned_ids_are_never_produced(params):
    # EOS and the stop id carry nearly all the mass; before min_tokens neither may come out
    logits = torch.zeros(40)
    logits[EOS], logits[11] = 30.0, 29.0
    batch = [req(params if params.seed is None else replace(params, seed=i), rid=f"r{i}") for i in range(300)]
    out = sample_requests(logits.expand(300, -1), batch)
    assert EOS not in out and 11 not in out
    for r in batch:
        r.output_token_ids.extend([20, 21, 22])  # min_tokens reached: both are allowed again
    assert EOS in sample_requests(logits.expand(300, -1), batch)


def test_penalties_follow_their_definitions():
    greedy = lambda **kw: SamplingParams(temperature=0, **kw)  # noqa: E731
    logits = torch.tensor([[2.0, 1.9, -1.0, -1.05, 0.0]])
    pick = lambda p, prompt=(4,), output=(): sample_requests(logits, [req(p, list(prompt), list(output))])[0]  # noqa: E731
    assert pick(greedy()) == 0
    assert pick(greedy(frequency_penalty=0.04), output=[0, 0]) == 0  # 2.0 - 0.08 > 1.9
    assert pick(greedy(frequency_penalty=0.06), output=[0, 0]) == 1  # 2.0 - 0.12 < 1.9
    assert pick(greedy(presence_penalty=0.06), output=[0, 0]) == 0  # once, whatever the count
    assert pick(greedy(presence_penalty=0.2), output=[0]) == 1
    assert pick(greedy(frequency_penalty=-0.2), output=[1]) == 1 and pick(greedy(presence_penalty=-0.2), output=[1]) == 1
    assert pick(greedy(repetition_penalty=1.1), prompt=[0]) == 1  # a prompt token: 2.0 / 1.1 < 1.9
    assert pick(greedy(repetition_penalty=1.1), output=[0]) == 1
    assert pick(greedy(repetition_penalty=1.02), prompt=[0]) == 0  # 2.0 / 1.02 > 1.9
    only_negatives = torch.tensor([[-1.0, -1.04, -5.0]])
    rep = req(greedy(repetition_penalty=1.1), prompt=[0])
    assert sample_requests(only_negatives, [rep]) == [1]  # a negative logit is multiplied: -1.1 < -1.04


def test_penalized_rows_sample_the_penalized_distribution():
    p = SamplingParams(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.5)
    prompt, output = [1, 6], [3, 3, 5]
    x = LOGITS.clone()
    for t in set(prompt) | set(output):
        x[t] = x[t] / 1.5 if x[t] > 0 else x[t] * 1.5
    for t in set(output):
        x[t] -= 0.5 * output.count(t) + 0.25
    torch.manual_seed(3)
    n = 20_000
    samples = torch.tensor(sample_requests(LOGITS.expand(n, -1), [req(p, prompt, output) for _ in range(n)]))
    assert_distribution(samples, reference(x, SamplingParams(temperature=0.8)))


def _steps(params: SamplingParams, rows: torch.Tensor, neighbours: list[SamplingParams] | None) -> list[int]:
    """The tokens a request draws over the steps of `rows` [steps, V], alone or in a batch of neighbours
    (different logits, parameters, histories and random states every step)."""
    r = req(params, output=[])
    others = [req(p, output=[3, 4], rid=f"n{j}") for j, p in enumerate(neighbours or [])]
    g = torch.Generator().manual_seed(99)
    torch.manual_seed(5)
    out = []
    for step, row in enumerate(rows):
        if not others:
            tok = sample_requests(row.unsqueeze(0), [r])[0]
        else:
            k = step % (len(others) + 1)  # the request's place in the batch moves
            batch = others[:k] + [r] + others[k:]
            logits = torch.randn(len(batch), rows.shape[1], generator=g) * 3
            logits[k] = row
            tok = sample_requests(logits, batch)[k]
        r.output_token_ids.append(tok)
        out.append(tok)
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=7),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=8),
    SamplingParams(temperature=1.2, min_p=0.02, top_p=0.95, seed=9, repetition_penalty=1.2, frequency_penalty=0.3),
    SamplingParams(temperature=0, presence_penalty=0.5),
], ids=["t1", "k-p", "minp-penalties", "greedy"])
def test_a_seeded_row_is_the_same_alone_or_in_any_batch(params):
    vocab = 49_152
    rows = torch.randn(24, vocab, generator=torch.Generator().manual_seed(1)) * 3
    neighbours = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_p=0.5),
                  SamplingParams(temperature=1.0, top_k=5, seed=3), SamplingParams(temperature=2.0, min_p=0.3, repetition_penalty=2.0),
                  SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=(1, 2, 3))] * 3
    alone = _steps(params, rows, None)
    assert len(set(alone)) > 1 or params.greedy
    assert _steps(params, rows, neighbours) == alone
    assert _steps(params, rows, neighbours[:5]) == alone
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert _steps(params, rows, neighbours[2:]) == alone
    finally:
        torch.set_num_threads(before)


def test_seeds_replay_and_differ():
    rows = torch.randn(16, 2000, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1.0, seed=1234)
    assert _steps(p, rows, None) == _steps(p, rows, None)
    assert _steps(p, rows, None) != _steps(SamplingParams(temperature=1.0, seed=99), rows, None)


@pytest.mark.parametrize("field, value", [
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("presence_penalty", float("inf")), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", True),
])
def test_new_params_are_validated(field, value):
    with pytest.raises(InvalidRequest) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field
