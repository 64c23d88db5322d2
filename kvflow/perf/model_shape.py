"""Model shape: the numbers of a decoder-only transformer that cost and memory depend on."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """Decoder-only transformer dimensions; byte counts use `dtype_bytes` per element."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int = 2
    gated_mlp: bool = False  # Llama-style SwiGLU has three MLP matrices, OPT/BLOOM two

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
               self.vocab, self.dtype_bytes) < 1:
            raise ValueError(f"model {self.name}: all dimensions must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads must be a multiple of kv_heads")

    @property
    def params_per_layer(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return attn + mlp

    @property
    def layer_weight_bytes(self) -> int:
        """W_0 of DéjàVu eq. 2/3: weight bytes of one layer."""
        return self.params_per_layer * self.dtype_bytes

    @property
    def head_weight_bytes(self) -> int:
        """Embedding and LM head (counted once: tied or not, one copy is read per step)."""
        return self.vocab * self.hidden * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.layers * self.layer_weight_bytes + self.head_weight_bytes

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """Key plus value bytes of one token in one layer."""
        return 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_bytes_per_token_layer

    def layers_per_stage(self, depth: int) -> int:
        """Layers on the most loaded stage when `depth` stages split the model as evenly as possible."""
        if not 1 <= depth <= self.layers:
            raise ValueError(f"pipeline depth {depth} must be in [1, {self.layers}] for {self.name}")
        return math.ceil(self.layers / depth)

    def stage_layers(self, depth: int, stage: int) -> int:
        """Layers of stage `stage` when `depth` stages split the model evenly, earlier stages taking
        the extra ones (the split the controller uses)."""
        q, r = divmod(self.layers, depth)
        if not 0 <= stage < depth or q == 0:
            raise ValueError(f"stage {stage} of a {depth}-stage pipeline is invalid for {self.name}")
        return q + (stage < r)


def _mha(name: str, layers: int, hidden: int, heads: int, ffn: int, vocab: int) -> ModelShape:
    return ModelShape(name, layers, hidden, heads, heads, hidden // heads, ffn, vocab)


MODELS: dict[str, ModelShape] = {
    "opt-13b": _mha("opt-13b", 40, 5120, 40, 20480, 50272),
    "opt-30b": _mha("opt-30b", 48, 7168, 56, 28672, 50272),
    "opt-66b": _mha("opt-66b", 64, 9216, 72, 36864, 50272),
    "bloom-176b": _mha("bloom-176b", 70, 14336, 112, 57344, 250880),
    "llama-2-70b": ModelShape("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000, gated_mlp=True),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, dtype_bytes=4, gated_mlp=True),
}


def model_shape(name: str) -> ModelShape:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None
