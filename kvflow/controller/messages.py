"""Control-plane messages between controller and workers: small dataclasses, one msgpack codec,
tensors as raw frames beside the header (never pickled)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass
class SeqStep:
    """One request's part of a step: `query_len` new tokens; after the step its KV holds `context_len`."""

    rid: str
    query_len: int
    context_len: int
    block_ids: list[int]


@dataclass
class Step:
    """Run one microbatch through a pipeline. Stage 0 gets `token_ids`; later stages get hidden states
    as the tensor frame. `kv_to`: for prompt pipelines in disaggregated mode, stream each request's KV
    to the token workers (request id -> token-pipeline block ids)."""

    mb: int
    step: int
    seqs: list[SeqStep]
    token_ids: list[int] = field(default_factory=list)
    kv_to: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class StepResult:
    """Last stage -> controller: last-token logits of each sequence (tensor frame)."""

    mb: int
    step: int
    rids: list[str]
    busy_s: float = 0.0


@dataclass
class Ready:
    """Worker -> controller after start-up: where to reach it."""

    name: str
    step_addr: str
    kv_addr: str = ""


@dataclass
class Wire:
    """Controller -> worker: where its output goes and which peers receive its KV."""

    next_addr: str  # next stage's step socket, or the controller's for the last stage
    kv_peers: list[tuple[int, int, str]] = field(default_factory=list)  # (layer_start, layer_end, kv_addr)


@dataclass
class Heartbeat:
    name: str
    busy_s: float
    steps: int
    kv_bytes_sent: int
    kv_bytes_received: int


@dataclass
class KVArrived:
    """Token worker -> controller: all expected KV of these requests is in its cache."""

    name: str
    rids: list[str]


@dataclass
class Free:
    """Controller -> worker: forget these requests (they finished or failed)."""

    rids: list[str]


@dataclass
class WorkerError:
    name: str
    message: str


@dataclass
class Shutdown:
    pass


_TYPES = {c.__name__: c for c in (Step, StepResult, Ready, Wire, Heartbeat, KVArrived, Free, WorkerError, Shutdown)}


def encode(msg: Any, tensor: torch.Tensor | None = None) -> list:
    """Frames for a message: [msgpack header] or [msgpack header, raw tensor bytes]."""
    head: dict[str, Any] = {"t": type(msg).__name__, "d": dataclasses.asdict(msg)}
    if tensor is None:
        return [msgpack.packb(head)]
    t = tensor.detach().contiguous().cpu()
    head["tensor"] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape)}
    return [msgpack.packb(head), memoryview(t.numpy()).cast("B") if t.numel() else b""]


def decode(frames: list) -> tuple[Any, torch.Tensor | None]:
    head = msgpack.unpackb(bytes(frames[0]), strict_map_key=False)
    cls = _TYPES.get(head.get("t"))
    if cls is None:
        raise ValueError(f"unknown message type {head.get('t')!r}")
    data = head["d"]
    if cls is Step:
        data["seqs"] = [SeqStep(**s) for s in data["seqs"]]
    if cls is Wire:
        data["kv_peers"] = [tuple(p) for p in data["kv_peers"]]
    msg = cls(**data)
    tensor = None
    spec = head.get("tensor")
    if spec is not None:
        if len(frames) != 2:
            raise ValueError(f"{cls.__name__} announces a tensor but carries {len(frames) - 1} frames")
        dtype = _DTYPES[spec["dtype"]]
        buf = bytearray(frames[1])
        n = 1
        for d in spec["shape"]:
            n *= d
        if len(buf) != n * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"{cls.__name__}: tensor frame of {len(buf)} bytes does not match {spec}")
        tensor = torch.frombuffer(buf, dtype=dtype).view(spec["shape"]) if n else torch.empty(spec["shape"], dtype=dtype)
    return msg, tensor
