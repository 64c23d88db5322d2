"""Performance models: what a prompt, a decode step, a KV transfer cost on given hardware.

The model shapes and machine specs are plain data, imported here; the performance models are
imported on first use (PEP 562), so a command that only checks a `--model` or `--machine` argument
does not pay for numpy."""

from __future__ import annotations

import importlib

from kvflow.perf.hardware import DEVICES, DeviceSpec, MachineSpec, cpu_device, machine
from kvflow.perf.model_shape import MODELS, ModelShape, model_shape

_LAZY = {"AnalyticPerfModel": "perf_model", "BatchShape": "perf_model", "PerfModel": "perf_model",
         "Profile": "profiled", "ProfiledPerfModel": "profiled", "Sample": "profiled"}
__all__ = ["DEVICES", "DeviceSpec", "MachineSpec", "cpu_device", "machine", "MODELS", "ModelShape", "model_shape", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kvflow.perf' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvflow.perf.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
