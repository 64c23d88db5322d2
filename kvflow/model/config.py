"""Shape and hyper-parameters of a Llama-family checkpoint, read from config.json or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "default", "linear" or "llama3" (the Llama-3.1 scheme)."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope scaling type {self.kind!r} (supported: default, linear, llama3)")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")

    @classmethod
    def from_hf(cls, d: dict[str, Any] | None) -> "RopeScaling":
        if not d:
            return cls()
        kind = d.get("rope_type", d.get("type", "default"))
        if kind == "default":
            return cls()
        kw: dict[str, Any] = {"kind": kind, "factor": float(d.get("factor", 1.0))}
        for key in ("low_freq_factor", "high_freq_factor"):
            if key in d:
                kw[key] = float(d[key])
        if "original_max_position_embeddings" in d:
            kw["original_max_position_embeddings"] = int(d["original_max_position_embeddings"])
        return cls(**kw)

    def inv_freq(self, head_dim: int, theta: float) -> list[float]:
        """Per-pair inverse frequencies after scaling (length head_dim // 2)."""
        base = [1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
        if self.kind == "default":
            return base
        if self.kind == "linear":
            return [f / self.factor for f in base]
        # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        out = []
        for f in base:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / self.factor)
            else:
                smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor
                )
                out.append((1 - smooth) * f / self.factor + smooth * f)
        return out


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a Llama-family model's shape."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "llama"

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, key) <= 0:
                raise ValueError(f"ModelConfig.{key} must be positive, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.max_position_embeddings <= 0:
            raise ValueError("max_position_embeddings must be positive")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_params(self) -> int:
        per_layer = (
            self.hidden_size * (self.q_size + 2 * self.kv_size)
            + self.q_size * self.hidden_size
            + 3 * self.hidden_size * self.intermediate_size
            + 2 * self.hidden_size
        )
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * per_layer + embed * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """K and V bytes one token occupies across all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_hf(cls, d: dict[str, Any], name: str = "llama") -> "ModelConfig":
        """Build from a Hugging Face `config.json` dictionary of a Llama-family model."""
        arch = d.get("model_type", "llama")
        if arch not in ("llama", "mistral", "smollm", "smollm2"):
            raise ValueError(f"unsupported model_type {arch!r}: kvflow serves Llama-family checkpoints")
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope = d.get("rope_scaling") or d.get("rope_parameters")
        theta = d.get("rope_theta")
        if theta is None and isinstance(d.get("rope_parameters"), dict):
            theta = d["rope_parameters"].get("rope_theta")
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=RopeScaling.from_hf(rope if isinstance(rope, dict) else None),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    def to_hf(self) -> dict[str, Any]:
        """The inverse of `from_hf`: a `config.json` that `transformers.LlamaConfig` reads."""
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
        if self.rope_scaling.kind != "default":
            rs = self.rope_scaling
            d["rope_scaling"] = {"rope_type": rs.kind, "factor": rs.factor}
            if rs.kind == "llama3":
                d["rope_scaling"].update(
                    low_freq_factor=rs.low_freq_factor,
                    high_freq_factor=rs.high_freq_factor,
                    original_max_position_embeddings=rs.original_max_position_embeddings,
                )
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) > 1 else self.eos_token_ids[0]
        return d
