"""`RouterConfig`: the instances behind the router, its placement policy and how it checks instances (frozen,
validated); `from_file` reads the same fields from a YAML or JSON file (`kvflow router --config`). `ScalingConfig`:
how the router sizes the instances it starts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from urllib.parse import urlparse

from kvflow.router.policies import POLICIES, PolicyConfig


# An instance's role in the pool: "mixed" runs whole requests; with P/D pools a request's prompt runs on a "prefill"
# instance (its first token) and the rest on a "decode" instance, which pulls the prompt's KV from it.
ROLES = ("mixed", "prefill", "decode")


def instance_url(url: str) -> str:
    """An instance's base URL, checked and without a trailing slash: http(s)://host:port."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.path not in ("", "/"):
        raise ValueError(f"an instance is a base URL such as http://127.0.0.1:8001, got {url!r}")
    return url.rstrip("/")


@dataclass(frozen=True)
class RouterConfig:
    instances: tuple[str, ...] = ()  # base URLs of `kvflow serve` instances (more may join at runtime)
    # P/D pools (Splitwise, DistServe): instances that run only prompts, and instances that decode after pulling the
    # prompt's KV from them; `instances` are the mixed pool (whole requests). Engines with a host tier (--host-kv-bytes)
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    policy: str = "prefix_aware"
    placement: PolicyConfig = field(default_factory=PolicyConfig)
    health_interval_s: float = 1.0  # how often each instance's /health and /metrics are read
    health_timeout_s: float = 2.0
    failure_threshold: int = 3  # consecutive failed checks that take an instance out (a failed stream: at once)
    connect_timeout_s: float = 5.0
    block_tokens: int = 16  # prompt tokens per entry of the router's prefix-hash chain
    cached_blocks: int = 1 << 16  # chain entries remembered per instance (least recently sent forgotten first)
    length_model: str = "all"  # which fit of `output_lengths.json` predicts output lengths
    max_resends: int = 3  # how many times one request may move to another instance after a failure
    launch: int = 0  # `kvflow serve` instances the router starts on this machine and keeps running (`router.fleet`)
    launch_prefill: int = 0  # ... and of its P/D pools (after the `launch` mixed ones)
    launch_decode: int = 0
    serve_args: tuple[str, ...] = ()  # their arguments (the fleet adds --host and --port)

    def __post_init__(self) -> None:
        for name in ("instances", "prefill", "decode"):
            object.__setattr__(self, name, tuple(dict.fromkeys(instance_url(u) for u in getattr(self, name))))
        if twice := (set(self.instances) & set(self.prefill)) | (set(self.instances) & set(self.decode)) | (
                set(self.prefill) & set(self.decode)):
            raise ValueError(f"an instance has one role (mixed, prefill or decode): {sorted(twice)}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("failure_threshold", "block_tokens", "cached_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_resends < 0:
            raise ValueError(f"max_resends must be >= 0, got {self.max_resends}")
        for name in ("launch", "launch_prefill", "launch_decode"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        object.__setattr__(self, "serve_args", tuple(str(a) for a in self.serve_args))

    def roles(self) -> dict[str, str]:
        """Every configured instance's URL and its role (`ROLES`)."""
        return {**dict.fromkeys(self.instances, "mixed"), **dict.fromkeys(self.prefill, "prefill"),
                **dict.fromkeys(self.decode, "decode")}

    @classmethod
    def from_file(cls, path: Path, **overrides) -> "RouterConfig":
        """The file's fields (`placement` a mapping of `PolicyConfig`'s), then `overrides` that are not None."""
        import yaml  # (here: the CLI builds its parser from this module and should not wait for yaml)

        raw = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping of router settings")
        known = {f.name for f in fields(cls)}
        if unknown := set(raw) - known:
            raise ValueError(f"{path}: unknown router setting(s) {sorted(unknown)}; known: {sorted(known)}")
        if isinstance(raw.get("placement"), dict):
            raw["placement"] = PolicyConfig(**raw["placement"])
        for key in ("instances", "prefill", "decode", "serve_args"):
            if key in raw:
                raw[key] = tuple(raw[key])
        return replace(cls(**raw), **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class ScalingConfig:
    """How the router sizes the instances it started (`kvflow.router.scaling`; `kvflow router --autoscale`)."""

    min_instances: int = 1
    max_instances: int = 4
    ttft_slo_s: float = 2.0
    tpot_slo_s: float = 0.2
    attainment: float = 0.9  # share of requests that must meet both SLOs
    window_s: float = 60.0  # the load measured over this past window
    interval_s: float = 10.0  # a decision every this many seconds
    scale_down_after: int = 3  # consecutive answers for fewer instances before one is retired
    trial_requests: int = 200  # requests one simulated trial replays

    def __post_init__(self) -> None:
        if not 1 <= self.min_instances <= self.max_instances:
            raise ValueError(f"need 1 <= min_instances <= max_instances, got {self.min_instances}, {self.max_instances}")
        for name in ("ttft_slo_s", "tpot_slo_s", "window_s", "interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if self.scale_down_after < 1 or self.trial_requests < 10:
            raise ValueError("scale_down_after must be >= 1 and trial_requests >= 10")
