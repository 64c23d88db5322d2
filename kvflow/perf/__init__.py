"""Performance models: what a prompt, a decode step, a KV transfer cost on given hardware."""

from kvflow.perf.hardware import DEVICES, DeviceSpec, MachineSpec, cpu_device, machine
from kvflow.perf.model_shape import MODELS, ModelShape, model_shape
from kvflow.perf.perf_model import AnalyticPerfModel, BatchShape, PerfModel
from kvflow.perf.profiled import Profile, ProfiledPerfModel, Sample

__all__ = ["DEVICES", "DeviceSpec", "MachineSpec", "cpu_device", "machine", "MODELS", "ModelShape",
           "model_shape", "AnalyticPerfModel", "BatchShape", "PerfModel", "Profile", "ProfiledPerfModel", "Sample"]
