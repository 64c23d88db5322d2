"""GGUF -> Hugging Face-style checkpoint: dequantized weights with HF names, config.json, tokenizer files."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import numpy as np
import torch

from kvflow.model.config import ModelConfig, RopeScaling

log = logging.getLogger(__name__)

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def config_from_gguf(reader, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (kvflow serves Llama-family models)")
    p = "llama."
    hidden = int(_field(reader, p + "embedding_length"))
    heads = int(_field(reader, p + "attention.head_count"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = _field(reader, p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    scaling_type = _field(reader, p + "rope.scaling.type")
    rope = RopeScaling()
    if scaling_type == "linear":
        rope = RopeScaling(kind="linear", factor=float(_field(reader, p + "rope.scaling.factor")))
    elif scaling_type not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, p + "feed_forward_length")),
        num_layers=int(_field(reader, p + "block_count")),
        num_heads=heads,
        num_kv_heads=int(_field(reader, p + "attention.head_count_kv", heads)),
        head_dim=int(_field(reader, p + "rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_field(reader, p + "rope.freq_base", 10000.0)),
        rope_scaling=rope,
        max_position_embeddings=int(_field(reader, p + "context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        name=name,
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half halves)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def dequantize_tensor(t) -> np.ndarray:
    """A GGUF tensor as float32 numpy, in PyTorch (row-major, reversed GGUF dims) shape."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(t.tensor_type)
    if qtype.name not in SUPPORTED_TYPES:
        raise ValueError(f"tensor {t.name}: GGUF type {qtype.name} is not supported ({', '.join(SUPPORTED_TYPES)})")
    arr = quants.dequantize(t.data, qtype).astype(np.float32, copy=False)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return arr.reshape(shape)


def convert_gguf(gguf_path: Path, out_dir: Path, name: str) -> ModelConfig:
    """Write out_dir/{config.json, model.safetensors, tokenizer files}; returns the model config."""
    import gguf
    from safetensors.torch import save_file

    from tqdm import tqdm

    reader = gguf.GGUFReader(str(gguf_path))
    cfg = config_from_gguf(reader, name)
    tensors: dict[str, torch.Tensor] = {}
    # dequantizing is most of a conversion's seconds: a bar over the tensors (on a terminal only)
    for t in tqdm(reader.tensors, desc="[kvflow] dequantizing", unit=" tensors", file=sys.stderr, disable=None,
                  leave=False):
        if t.name in _GLOBAL_NAMES:
            hf = _GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".")  # blk.N.kind.weight
            if parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
                log.warning("skipping unknown GGUF tensor %s", t.name)
                continue
            hf = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
        w = dequantize_tensor(t)
        if t.name.endswith("attn_q.weight"):
            w = _unpermute(w, cfg.num_heads)
        elif t.name.endswith("attn_k.weight"):
            w = _unpermute(w, cfg.num_kv_heads)
        tensors[hf] = torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2))
    if "tokenizer.ggml.tokens" in reader.fields:
        _convert_tokenizer(gguf_path, out_dir)
    else:
        log.warning("%s carries no tokenizer: prompts must be given as token ids", gguf_path)
    return cfg


def _convert_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """The checkpoint's tokenizer as transformers builds it from the GGUF, saved as tokenizer.json."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
