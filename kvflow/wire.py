"""Messages between the controller and the worker processes, and their one codec.

Belongs to neither side: both import it. Messages are small dataclasses packed with msgpack; a tensor travels
as a raw frame beside the header, never pickled. Every message is authenticated: the frames are
`[header, mac, (tensor)]`, `mac` a keyed BLAKE2b over header and tensor bytes with the cluster's secret (handed
to each worker at launch; `kvflow.wire_auth`), so a stranger who can reach a port cannot inject steps. `decode` never raises
anything but `WireError` for bytes it does not accept (bad MAC, not msgpack, unknown type, wrong field types,
a tensor frame of the wrong size): the loop that receives drops the message and counts it.

Steps are deltas: a request's first step after admission (or preemption) carries its whole block table
(`full_table`), later ones only the blocks added. Every step and result carries the controller's `epoch`, so
a result from before a recovery is recognised as stale and dropped.
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import itertools
import operator
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from kvflow.wire_auth import mac as _mac

TENSOR_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
_DTYPE_NAMES = {v: k for k, v in TENSOR_DTYPES.items()}
SECRET_ENV = "KVFLOW_CLUSTER_SECRET"


class WireError(ValueError):
    """Bytes that are not a valid, authentic message."""


def new_secret() -> bytes:
    return os.urandom(32)


# ---------------------------------------------------------------------------------------- messages
@dataclass
class SeqStep:
    """One request's part of a step: `num_new` tokens from position `start`. `new_blocks` are
    appended to the stage's copy of the request's block table, or replace it when `full_table`."""

    rid: str
    start: int
    num_new: int
    new_blocks: list[int]
    full_table: bool = False
    device_blocks: list[int] = field(default_factory=list)  # swapping: its blocks in the step's device region

    @property
    def context_len(self) -> int:
        return self.start + self.num_new


@dataclass
class KVOut:
    """Disaggregated prompt step: tokens [token_start, token_end) of `rid` go to the token pipeline,
    into `dest_blocks` (its block table there, covering [0, total)), which expects [dest_start,
    total): its prefix cache holds the tokens before."""

    rid: str
    token_start: int
    token_end: int
    total: int
    dest_blocks: list[int]
    dest_start: int = 0


@dataclass
class Step:
    """Run one batch through a pipeline. Stage 0 gets `token_ids`; later stages get the hidden states
    as the tensor frame. `free`: requests to forget first. `kv_out` + `kv_plan`: the connector's plan
    (prompt pipelines of the disaggregated mode): `streaming.topology.Transfer`s as field lists
    [src, dst, layer_start, layer_end, request_start, request_end, src_microbatch, dst_microbatch]
    over the order of `kv_out`."""

    epoch: int
    batch: int
    seqs: list[SeqStep]
    token_ids: list[int] = field(default_factory=list)
    free: list[str] = field(default_factory=list)
    kv_out: list[KVOut] = field(default_factory=list)
    kv_plan: list[list[int]] = field(default_factory=list)
    tier_ops: list[list[int]] = field(default_factory=list)  # kv.tiers.TierPlan.to_wire(): done before the forward
    tier_failed: list[int] = field(default_factory=list)  # host slots whose disk block a stage rejected (so far)
    swap_region: int = -1  # microbatch swapping: the device region the step computes in (-1: none)
    argmax_rows: list[int] = field(default_factory=list)  # rows whose token is their logits' argmax: taken on the last stage
    busy_s: float = 0.0  # compute seconds of the stages before this one (a stage adds its own before forwarding)
    hidden: list = field(default_factory=list)  # its input in the stage's hidden ring, [slot, dtype, *shape] (no frame)


@dataclass
class StepResult:
    """Last stage -> controller (and a decode-ahead stage 0): last-token logits of each sequence not in
    the step's `argmax_rows` (tensor frame, in row order), and the argmax of each that is."""

    epoch: int
    batch: int
    rids: list[str]
    busy_s: float = 0.0  # compute seconds of the step in every stage of the pipeline, summed
    tier_failed: list[int] = field(default_factory=list)  # host slots whose disk block any stage rejected
    argmax_rows: list[int] = field(default_factory=list)  # the step's `argmax_rows`, whose tokens are
    argmax_ids: list[int] = field(default_factory=list)  # these (the tensor holds the other rows),
    positions: list[int] = field(default_factory=list)  # at these positions (sent to a decode-ahead stage 0 too)


@dataclass
class Hello:
    """Worker -> controller at start: who it is and where its step socket listens. Sized from GPU
    memory, a stage says Hello again once it has loaded its layers, with what it measured
    (`engine.memory.StageMemory` as a dict), and waits for a Setup with its pipeline's pool."""

    name: str
    step_addr: str
    memory: dict = field(default_factory=dict)


@dataclass
class Setup:  # controller -> worker: what to be (a `WorkerSpec` and the `EngineConfig` subtree, as dicts)
    spec: dict
    engine: dict
    epoch: int = 0


@dataclass
class Ready:
    """Worker -> controller once its layers are loaded: where it receives KV into its cache (token
    role, or any role restoring after a failure), and into the replica it holds of the previous stage
    (mapped from `WorkerSpec.replica_shm` or not); its model's `LlamaModel.kernel_variant`; whether it
    mapped its hidden-state ring (`WorkerSpec.hidden_shm`); the CPU linear paths it chose per small
    row count (`model.linear.chosen_small_paths`: what a replacement of it adopts)."""

    name: str
    kv_addr: str = ""
    replica_addr: str = ""
    kernel_variant: str = ""
    replica_shm: bool = False
    hidden_shm: bool = False
    small_paths: list[str] = field(default_factory=list)


@dataclass
class Route:
    """Controller -> worker: where its output goes (`next_addr`: the next stage, or the controller),
    which token stages receive its KV, as [stage index, layer_start, layer_end, kv address], and
    where its KV replica goes. Sent at start and again when a neighbour was replaced."""

    next_addr: str
    kv_peers: list[list] = field(default_factory=list)
    token_bounds: list[int] = field(default_factory=list)
    replica_to: str = ""  # the replica port of the stage holding this stage's replica ("": none)
    replica_shm: str = ""  # or its shared-memory segment (the controller's), to write in place if mapped here
    ids_to: str = ""  # decoding ahead, the last stage of a deeper pipeline: stage 0's step port (its results too)
    hidden_to: str = ""  # the next stage's hidden-state ring (mapped there): its output goes in it, not in a frame


@dataclass
class Heartbeat:
    name: str
    busy_s: float
    steps: int
    kv_bytes_sent: int
    kv_bytes_received: int
    dropped_messages: int = 0
    replica_bytes_sent: int = 0
    hidden_bytes: int = 0  # hidden states written into the next stage's ring
    swap: dict = field(default_factory=dict)  # microbatch swapping: the worker's `Swapper.stats`
    launched_ahead: int = 0  # steps launched on the device before the one before was read back (`worker.compute`)


@dataclass
class KVArrived:  # token worker -> controller: all planned KV of these requests is in its cache
    name: str
    rids: list[str]


@dataclass
class Replicated:
    """Holder -> controller: its replica of the previous stage (or of `stage`, written in place in a step of
    `epoch`) holds tokens [start, end) of these requests (the watermark advances when start <= it)."""

    name: str
    rids: list[str]
    starts: list[int]
    ends: list[int]
    stage: int = -1
    epoch: int = -1


@dataclass
class Restore:
    """Controller -> worker during a recovery: send tokens [0, n) of these requests, as [request id,
    n, block table], from its own cache ("main") or from the replica it holds ("replica"), to the KV
    port `to_addr` of stage `dst_stage` (the same block ids there)."""

    epoch: int
    source: str
    to_addr: str
    dst_stage: int
    items: list[list]


@dataclass
class WorkerError:
    name: str
    message: str
    epoch: int = -1  # the epoch of the step that failed (-1: not tied to a step)
    peer_gone: bool = False  # it failed because a peer it streams to disconnected (maybe that peer died)


@dataclass
class Fence:
    """Controller -> worker after a failure: only steps of `epoch` count; forget the mirrored block tables and partial KV."""

    epoch: int
    tables: bool = True
    kv: bool = True


@dataclass
class Shutdown:  # controller -> worker: stop
    pass


MESSAGES = (Step, StepResult, Hello, Setup, Ready, Route, Heartbeat, KVArrived, Replicated, Restore, WorkerError, Fence, Shutdown)
_TYPES = {c.__name__: c for c in MESSAGES}
_NESTED = {"seqs": SeqStep, "kv_out": KVOut}


# ---------------------------------------------------------------------------------------- codec
@functools.cache
def _layout(cls: type) -> tuple[tuple[str, type | None], ...]:
    """(name, nested class or None) per field of a message class: a list of nested messages (a step's
    sequences) travels as one list per field of the nested class, not as one mapping per item."""
    hints = typing.get_type_hints(cls)
    nested = set(_NESTED.values())
    return tuple((f.name, typing.get_args(hints[f.name])[0] if typing.get_origin(hints[f.name]) is list
                  and typing.get_args(hints[f.name])[0] in nested else None) for f in dataclasses.fields(cls))


@functools.cache
def _row_getter(cls: type) -> tuple[tuple[str, ...], Callable[[Any], tuple]]:
    """A nested class's field names in order, and a getter of an item's values in that order."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    return names, operator.attrgetter(*names)


def _to_dict(msg: Any) -> dict[str, Any]:
    """`dataclasses.asdict` for messages, without its deep copy of every value (msgpack only reads
    them); a list of nested messages as columns (field -> the items' values in order), which decode in
    one pass per field instead of one mapping, one key check and one constructor call per item."""
    out = {}
    for name, nested in _layout(type(msg)):
        v = getattr(msg, name)
        if nested is not None:
            names, row = _row_getter(nested)
            cols = list(zip(*map(row, v))) if v else [()] * len(names)
            v = {n: list(c) for n, c in zip(names, cols)}
        out[name] = v
    return out


def encode(msg: Any, secret: bytes, tensor: torch.Tensor | None = None) -> list:
    """Frames for a message: [header, mac] or [header, mac, raw tensor bytes]."""
    head: dict[str, Any] = {"t": type(msg).__name__, "d": _to_dict(msg)}
    payload = None
    if tensor is not None:
        t = tensor.detach().contiguous().cpu()
        head["tensor"] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape)}
        payload = memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else b""
    header = msgpack.packb(head)
    frames = [header, _mac(secret, header, payload)]
    if payload is not None:
        frames.append(payload)
    return frames


_PRIMS = {int: frozenset({int}), float: frozenset({int, float}), str: frozenset({str}), bool: frozenset({bool}), dict: frozenset({dict})}
_LIST = frozenset({list})


@functools.cache
def _checker(tp: Any) -> Callable[[Any, str], Any]:
    """The check of a value of field type `tp`, built once per type: a list of plain values (token
    ids, block ids) is accepted in one pass over its element types, not one call per element."""
    origin = typing.get_origin(tp)
    if origin is list:
        (inner,) = typing.get_args(tp) or (Any,)
        if inner in _NESTED.values():  # sent as columns (`_to_dict`)
            return functools.partial(_build_columns, inner)
        each, plain = _checker(inner), _PRIMS.get(inner)
        # a list of lists of plain values (a column of block tables): one pass over all of them
        deep = _PRIMS.get(typing.get_args(inner)[0]) if typing.get_origin(inner) is list and typing.get_args(inner) else None

        def listed(value: Any, where: str) -> Any:
            if not isinstance(value, list):
                raise WireError(f"{where}: expected a list")
            if plain is not None and set(map(type, value)) <= plain:  # (bool is not int here)
                return value
            if deep is not None and set(map(type, value)) <= _LIST and set(map(type, itertools.chain.from_iterable(value))) <= deep:
                return value
            return [each(v, f"{where}[]") for v in value]
        return listed
    ok = None if tp is Any or origin is not None else _PRIMS.get(tp)
    if ok is None:
        return lambda value, where: value

    def prim(value: Any, where: str) -> Any:
        if type(value) in ok:  # (the common case, bool never passing for int)
            return value
        if not isinstance(value, tuple(ok)) or (tp is not bool and isinstance(value, bool)):
            raise WireError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    return prim


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Callable[[Any, str], Any]], frozenset[str], frozenset[str]]:
    """A message class's check per field, field names and required fields, worked out once per class
    (`typing.get_type_hints` on every message was a quarter of a pipeline worker's busy time)."""
    fields = dataclasses.fields(cls)
    required = frozenset(f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    checks = {name: _checker(tp) for name, tp in typing.get_type_hints(cls).items()}
    return checks, frozenset(f.name for f in fields), required


def _build(cls: type, data: dict, where: str) -> Any:
    checks, names, required = _schema(cls)
    _check_keys(data, names, required, where)
    return cls(**{k: checks[k](v, where + "." + k) for k, v in data.items()})


def _check_keys(data: dict, names: frozenset[str], required: frozenset[str], where: str) -> None:
    keys = data.keys()
    if not keys <= names:
        raise WireError(f"{where}: unknown fields {sorted(map(str, set(data) - names))}")
    if not required <= keys:
        raise WireError(f"{where}: missing fields {sorted(required - set(data))}")


@functools.cache
def _column_schema(cls: type) -> tuple[dict[str, Callable[[Any, str], Any]], frozenset[str], frozenset[str], tuple[str, ...]]:
    """A nested class's check per column (a list of the field's type), names, required, field order."""
    _, names, required = _schema(cls)
    checks = {name: _checker(list[tp]) for name, tp in typing.get_type_hints(cls).items()}
    return checks, names, required, _row_getter(cls)[0]


def _build_columns(cls: type, value: Any, where: str) -> list:
    """The items of a nested list sent as columns (`_to_dict`): each column checked in one pass."""
    if not isinstance(value, dict):
        raise WireError(f"{where}: expected a mapping of field lists")
    checks, names, required, order = _column_schema(cls)
    _check_keys(value, names, required, where)
    cols, n = [], -1
    for k, col in value.items():
        col = checks[k](col, where + "." + k)
        if n not in (-1, len(col)):
            raise WireError(f"{where}: its field lists differ in length")
        n = len(col)
        cols.append(col)
    if tuple(value) == order:  # (as `_to_dict` sends them: positional, the fast way)
        return list(map(cls, *cols))
    return [cls(**dict(zip(value, row))) for row in zip(*cols)]


def decode(frames: list, secret: bytes) -> tuple[Any, torch.Tensor | None]:
    """The message and tensor in `frames`, or WireError (never another exception)."""
    if not 2 <= len(frames) <= 3:
        raise WireError(f"a message has 2 or 3 frames, got {len(frames)}")
    header, mac = bytes(frames[0]), bytes(frames[1])
    payload = frames[2] if len(frames) == 3 else None
    pbytes = None if payload is None else (payload.buffer if hasattr(payload, "buffer") else payload)
    if not hmac.compare_digest(mac, _mac(secret, header, pbytes)):
        raise WireError("bad message authentication code")
    try:
        head = msgpack.unpackb(header, strict_map_key=False)
    except Exception as e:  # msgpack raises several types for bad bytes
        raise WireError(f"header is not msgpack: {type(e).__name__}") from None
    if not isinstance(head, dict) or not isinstance(head.get("d"), dict):
        raise WireError("header is not a message")
    cls = _TYPES.get(head.get("t")) if isinstance(head.get("t"), str) else None
    if cls is None:
        raise WireError(f"unknown message type {head.get('t')!r}")
    try:
        msg = _build(cls, head["d"], cls.__name__)
    except WireError:
        raise
    except Exception as e:
        raise WireError(f"{cls.__name__}: {type(e).__name__}: {e}") from None
    spec = head.get("tensor")
    if spec is None:
        if payload is not None:
            raise WireError(f"{cls.__name__} carries a frame it does not announce")
        return msg, None
    try:
        dtype = TENSOR_DTYPES[spec["dtype"]]
        shape = [int(d) for d in spec["shape"]]
        if any(d < 0 for d in shape):
            raise ValueError("negative dimension")
    except Exception:
        raise WireError(f"{cls.__name__}: bad tensor spec {spec!r}") from None
    if payload is None:
        raise WireError(f"{cls.__name__} announces a tensor but carries none")
    n = functools.reduce(operator.mul, shape, 1)
    buf = bytearray(pbytes)
    if len(buf) != n * torch.empty((), dtype=dtype).element_size():
        raise WireError(f"{cls.__name__}: tensor frame of {len(buf)} bytes does not match {spec}")
    tensor = torch.frombuffer(buf, dtype=dtype).view(shape) if n else torch.empty(shape, dtype=dtype)
    return msg, tensor
