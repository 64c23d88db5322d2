"""Discrete-event simulator of colocated, data-parallel and disaggregated pipeline serving."""

from kvflow.simulator.config import Failure, Layout, PipelineSpec, Recovery, SimConfig
from kvflow.simulator.metrics import SLO, SimResult, Summary
from kvflow.simulator.simulator import Simulator, simulate
from kvflow.simulator.workload import LengthDist, Workload, azure_trace, synthetic

__all__ = ["Failure", "Layout", "PipelineSpec", "Recovery", "SimConfig", "SLO", "SimResult", "Summary",
           "Simulator", "simulate", "LengthDist", "Workload", "azure_trace", "synthetic"]
