"""Discrete-event simulator of colocated, data-parallel and disaggregated pipeline serving."""

from kvflow.simulator.config import Failure, Layout, PipelineGroup, Recovery, SimConfig
from kvflow.simulator.metrics import SimResult, Summary
from kvflow.simulator.simulator import Simulator, simulate
from kvflow.simulator.workload import LengthDist, Workload, azure_trace, synthetic

__all__ = ["Failure", "Layout", "PipelineGroup", "Recovery", "SimConfig", "SimResult", "Summary",
           "Simulator", "simulate", "LengthDist", "Workload", "azure_trace", "synthetic"]
