"""The DéjàVu planner (Appendix D formulas + simulated search) and DistServe-style goodput search."""

from kvflow.planner.formulas import Infeasible, Split, balanced_split
from kvflow.planner.goodput import Goodput, best_goodput, max_rate
from kvflow.planner.plan import FormulaReport, Plan, formula_report, recommend
from kvflow.planner.search import SearchSpace, best_per_kind, colocated_layouts, disaggregated_layouts, evaluate

__all__ = ["Infeasible", "Split", "balanced_split", "Goodput", "best_goodput", "max_rate", "FormulaReport", "Plan",
           "formula_report", "recommend", "SearchSpace", "best_per_kind", "colocated_layouts",
           "disaggregated_layouts", "evaluate"]
