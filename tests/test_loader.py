"""Weights loading: a tiny GGUF (F32/F16/Q8_0/Q4_1, llama.cpp Q/K permutation) and a HF-style directory."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvflow.model.loader import load_checkpoint

from conftest import tiny_config, tiny_state_dict

_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's conversion of HF Q/K rows (what our loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, cfg, sd, qtypes):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(2)
    for hf_name, t in sd.items():
        arr = t.numpy().astype(np.float32)
        if hf_name.startswith("model.layers."):
            _, _, i, rest = hf_name.split(".", 3)
            name = f"blk.{i}.{_GGUF_NAMES[rest]}"
            if rest.startswith("self_attn.q_proj"):
                arr = _permute(arr, cfg.num_heads)
            elif rest.startswith("self_attn.k_proj"):
                arr = _permute(arr, cfg.num_kv_heads)
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}[hf_name]
        q = qtypes(name, arr)
        if q.name == "F32" or arr.ndim == 1:
            w.add_tensor(name, arr)
        elif q.name == "F16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_gguf_f32_round_trip_is_exact_and_second_load_uses_cache(tmp_path, cache_dir):
    import gguf

    cfg = tiny_config(num_layers=2, max_position_embeddings=256)
    sd = tiny_state_dict(cfg, seed=3)
    path = tmp_path / "tiny-f32.gguf"
    write_tiny_gguf(path, cfg, sd, lambda name, arr: gguf.GGMLQuantizationType.F32)
    ck = load_checkpoint(path)
    assert ck.converted and ck.config.num_layers == 2 and ck.config.num_kv_heads == 2
    assert ck.config.eos_token_ids == (2,) and not ck.config.tie_word_embeddings
    for k, v in sd.items():
        assert torch.equal(ck.state_dict[k], v), k
    warm = load_checkpoint(path)
    assert not warm.converted and warm.directory == ck.directory
    assert torch.equal(warm.state_dict["model.layers.1.self_attn.q_proj.weight"], sd["model.layers.1.self_attn.q_proj.weight"])


def test_conversions_are_keyed_by_content_and_shared_by_copies(tmp_path, cache_dir):
    # another checkout or environment holds its own copy of the model file (another path, another
    # mtime): it reuses the first conversion; a file whose bytes differ gets its own
    import os
    import shutil

    import gguf

    cfg = tiny_config(num_layers=1, hidden_size=64, intermediate_size=128)
    first = tmp_path / "a" / "tiny.gguf"
    first.parent.mkdir()
    write_tiny_gguf(first, cfg, tiny_state_dict(cfg, seed=5), lambda name, arr: gguf.GGMLQuantizationType.F32)
    copy = tmp_path / "b" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copyfile(first, copy)
    os.utime(copy, ns=(1, 1))
    a, b = load_checkpoint(first), load_checkpoint(copy)
    assert a.converted and not b.converted and a.directory == b.directory
    assert sorted(p.name for p in (cache_dir / "converted").iterdir()) == [a.directory.name, a.directory.name + ".lock"]
    other = tmp_path / "c" / "tiny.gguf"
    other.parent.mkdir()
    write_tiny_gguf(other, cfg, tiny_state_dict(cfg, seed=6), lambda name, arr: gguf.GGMLQuantizationType.F32)
    c = load_checkpoint(other)
    assert c.converted and c.directory != a.directory


def test_concurrent_loads_convert_once(tmp_path, cache_dir):
    # two processes loading one new model at once: one converts, the other waits for it (or finds
    # it done); neither sees a half-written conversion, and nothing temporary is left behind
    import subprocess
    import sys

    import gguf

    cfg = tiny_config(num_layers=2)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, cfg, tiny_state_dict(cfg, seed=7), lambda name, arr: gguf.GGMLQuantizationType.Q8_0)
    code = ("import sys\nfrom kvflow.model.loader import load_checkpoint\n"
            "ck = load_checkpoint(sys.argv[1])\nprint(ck.directory, len(ck.state_dict))\n")
    env = {**__import__("os").environ, "KVFLOW_CACHE_DIR": str(cache_dir), "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[0][0] == outs[1][0]  # the same directory, every tensor
    assert sum(err.count("[kvflow] converting tiny.gguf") for _, err in outs) == 1, outs
    assert not list((cache_dir / "converted").glob("*.tmp-*"))


@pytest.mark.parametrize("qname, tol", [("F16", 2e-3), ("Q8_0", 2e-2), ("Q4_1", 0.12)])
def test_gguf_quantized_tensors_dequantize_close(tmp_path, cache_dir, qname, tol):
    import gguf

    cfg = tiny_config(num_layers=1, hidden_size=64, intermediate_size=128)
    sd = tiny_state_dict(cfg, seed=4)
    path = tmp_path / f"tiny-{qname}.gguf"
    q = getattr(gguf.GGMLQuantizationType, qname)
    write_tiny_gguf(path, cfg, sd, lambda name, arr: q)
    ck = load_checkpoint(path)
    for k, v in sd.items():
        got = ck.state_dict[k]
        assert got.shape == v.shape, k
        err = (got - v).abs().max().item() / v.abs().max().item()
        assert err < tol, (k, err)


def test_hf_directory_loads_with_tokenizer_and_generates_text(tiny_ckpt_dir):
    from kvflow import LLM, SamplingParams

    llm = LLM(str(tiny_ckpt_dir), num_kv_blocks=64, block_size=4)
    assert llm.engine.model.cfg.num_layers == 2 and llm.tokenizer is not None
    ids = llm.tokenizer.encode("w10 w11 <|user|> w12")
    assert ids == [10, 11, 3, 12]
    out = llm.generate(["w10 w11 w12", [20, 21, 22]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    assert [len(o.token_ids) for o in out] == [6, 6] and all(o.finish_reason == "length" for o in out)
    assert out[0].text == llm.tokenizer.decode(out[0].token_ids)
    chat = llm.chat([{"role": "user", "content": "w30 w31"}], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert chat.prompt_token_ids == [3, 30, 31, 4]


def test_stop_strings_cut_text_and_stream_deltas_add_up(tiny_ckpt_dir):
    from kvflow import LLM, SamplingParams

    llm = LLM(str(tiny_ckpt_dir), num_kv_blocks=64, block_size=4)
    free = llm.generate("w10 w11 w12", SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    words = free.text.split(" ")
    stop = words[3]
    cut = free.text[: free.text.index(stop)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=(stop, "never-appears"))
    got = llm.generate("w10 w11 w12", params, use_tqdm=False)[0]
    assert got.finish_reason == "stop" and got.text == cut
    chunks = list(llm.stream("w10 w11 w12", params))
    assert "".join(c.new_text for c in chunks) == cut and chunks[-1].finished
    assert [t for c in chunks for t in c.new_token_ids] == got.token_ids


def test_missing_model_and_bad_arguments_are_clear(tmp_path):
    from kvflow import LLM

    with pytest.raises(FileNotFoundError, match="never downloads"):
        LLM("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM(None, max_batch=3)


def test_a_stage_reads_only_its_own_tensors(tiny_ckpt_dir):
    from kvflow.model.llama import LlamaModel
    from kvflow.model.loader import load_config

    mc, _ = load_config(tiny_ckpt_dir)
    full = load_checkpoint(tiny_ckpt_dir)
    first = load_checkpoint(tiny_ckpt_dir, want=LlamaModel.tensor_filter(mc, (0, 1)))
    last = load_checkpoint(tiny_ckpt_dir, want=LlamaModel.tensor_filter(mc, (1, 2)))
    assert set(first.state_dict) == {k for k in full.state_dict if k.startswith("model.layers.0.")} | {"model.embed_tokens.weight"}
    assert set(last.state_dict) == {k for k in full.state_dict if k.startswith("model.layers.1.")} | {"model.norm.weight", "lm_head.weight"}
    m = LlamaModel.from_state_dict(mc, last.state_dict, (1, 2))
    assert m.is_last and m.embed_tokens is None and torch.equal(m.lm_head, full.state_dict["lm_head.weight"])
