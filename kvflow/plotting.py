"""matplotlib for the plots (`kvflow bench serve`, `kvflow simulate --scenario`, the benchmarks): an
optional dependency, the `plot` extra, so that serving installs without it. `pyplot()` is the one
place that imports it; without it a plot asked for fails with `MissingExtra`, which says what to install."""

from __future__ import annotations


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def pyplot():
    """`matplotlib.pyplot` on the non-interactive Agg backend (files only, no display needed)."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise MissingExtra("plots need matplotlib, kvflow's `plot` extra: pip install 'kvflow[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
