"""Long prompt chunks through PyTorch's SDPA on the fast path (`kvflow.model.prompt_attention`), the paged kernel elsewhere."""

from __future__ import annotations

import pytest
import torch

from kvflow.model import cpu_kernels, prompt_attention
from kvflow.model.batch import ForwardBatch, SeqSlice
from kvflow.model.llama import LlamaModel

from kvflow.kv.cache import KVCache, KVLayout

from conftest import tiny_config, tiny_state_dict

pytestmark = pytest.mark.skipif(not cpu_kernels.available(torch.device("cpu")), reason="no C++ kernels here")


def _model(deterministic: bool, dtype=torch.float32) -> LlamaModel:
    cfg = tiny_config()
    return LlamaModel.from_state_dict(cfg, tiny_state_dict(cfg), dtype=dtype, deterministic=deterministic)


def test_forced_choice_and_bad_value(monkeypatch):
    monkeypatch.setenv("KVFLOW_PROMPT_ATTENTION", "paged")
    assert prompt_attention.choose_prompt_paths(4, 2, 16, torch.float32) == (None, None)
    monkeypatch.setenv("KVFLOW_PROMPT_ATTENTION", "sdpa")
    assert prompt_attention.choose_prompt_paths(4, 2, 16, torch.float32) == (None, 2)  # every prompt chunk is >= 2 tokens
    monkeypatch.setenv("KVFLOW_PROMPT_ATTENTION", "amx")  # (no AMX kernel for float32: the paged kernel)
    assert prompt_attention.choose_prompt_paths(4, 2, 16, torch.float32) == (None, None)
    monkeypatch.setenv("KVFLOW_PROMPT_ATTENTION", "flash")
    with pytest.raises(ValueError, match="KVFLOW_PROMPT_ATTENTION"):
        prompt_attention.choose_prompt_paths(4, 2, 16, torch.float32)


def test_measured_choice_is_a_measured_length_and_never_batch_invariant(monkeypatch):
    monkeypatch.delenv("KVFLOW_PROMPT_ATTENTION", raising=False)
    fast = _model(deterministic=False)
    assert fast.sdpa_from in (None, *prompt_attention.MEASURED_LENS)
    assert fast.amx_from is None  # (head_dim 16: no AMX kernel)
    exact = _model(deterministic=True)
    assert exact.sdpa_from is None and exact.amx_from is None  # a batch-invariant model keeps one kernel for every row


def test_prompt_bands_split_chunks_by_length_once_per_step():
    seqs = [SeqSlice(0, 12, 12, (0, 1, 2)), SeqSlice(12, 5, 5, (3, 4)), SeqSlice(17, 1, 9, (5, 6, 7)),
            SeqSlice(18, 4, 10, (8, 9, 10))]
    batch = ForwardBatch.build(seqs, 4)
    mid, long, rest = batch.prompt_bands(None, 8)
    assert mid is None and long == [0]  # the 5-token prompt and the 4-token chunk are short, the decode row is no chunk
    assert rest[2].tolist() == [5, 4] and rest[3].tolist() == [5, 10] and rest[1].tolist() == [12, 18]
    assert rest[0].tolist() == batch.prefill_block_table[1:].tolist()
    mid, long, rest = batch.prompt_bands(5, 8)  # the 5-token prompt in the middle band
    assert long == [0] and mid[2].tolist() == [5] and mid[1].tolist() == [12] and rest[2].tolist() == [4]
    assert rest[0].tolist() == batch.prefill_block_table[2:].tolist()
    assert batch.prompt_bands(5, 8) is batch.prompt_bands(5, 8)  # once per step, for every layer
    mid, none, everything = batch.prompt_bands(None, None)
    assert mid is None and none == [] and everything[0] is batch.prefill_block_table
    every, nothing, left = batch.prompt_bands(2, None)
    assert every[0] is batch.prefill_block_table and nothing == [] and left is None


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
def test_long_chunks_take_sdpa_and_agree_with_the_paged_kernel(monkeypatch, dtype, tol):
    model = _model(deterministic=False, dtype=dtype)
    cfg = model.cfg
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (12, 5, 10)]

    def step(kv, sdpa_from):
        model.sdpa_from = sdpa_from
        # cached before the step: the third prompt's first 6 tokens, and the first prompt's under other blocks
        kv0 = ForwardBatch.build([SeqSlice(0, 6, 6, (20, 21)), SeqSlice(6, 6, 6, (30, 31))], 4)
        model.forward(torch.tensor(prompts[2][:6] + prompts[0][:6]), kv0, kv)
        calls.clear()
        # one step: a whole prompt of 12, one of 5, the third's last 4 after its cached 6 (masked, over K/V
        # gathered from the cache), and a decode row of the first prompt's 6
        seqs = [SeqSlice(0, 12, 12, (0, 1, 2)), SeqSlice(12, 5, 5, (3, 4)), SeqSlice(17, 4, 10, (20, 21, 22)),
                SeqSlice(21, 1, 7, (30, 31))]
        ids = prompts[0] + prompts[1] + prompts[2][6:] + [prompts[0][6]]
        return model.forward(torch.tensor(ids), ForwardBatch.build(seqs, 4), kv)

    calls = []
    real = prompt_attention.attend_chunk
    monkeypatch.setattr(prompt_attention, "attend_chunk", lambda q, *a: calls.append(q.shape[0]) or real(q, *a))
    def cache():
        return KVCache(KVLayout.for_model(cfg, 64, 4, dtype=dtype))

    via_kernel = step(cache(), None)
    assert calls == []
    for sdpa_from, taken in ((8, [12]), (4, [12, 5, 4])):
        via_sdpa = step(cache(), sdpa_from)
        assert calls == taken * cfg.num_layers  # the chunks of sdpa_from tokens or more, once per layer
        assert (via_sdpa.float() - via_kernel.float()).abs().max().item() < tol
