"""The output-length predictor of length-aware placement (TetriInfer, Aladdin): quantiles of the generated length per
prompt-length bucket, fit on the Azure traces of `../shared/traces/` and shipped as `output_lengths.json`.

Buckets are powers of two of the prompt length (bucket b holds prompts of 2^b to 2^(b+1) - 1 tokens); a bucket with
fewer than `MIN_SAMPLES` requests takes the quantiles of the whole trace. `python -m kvflow.router.length TRACE.csv
...` refits the file (one model per trace, named by its file's last `_` part, plus "all", their union).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).with_name("output_lengths.json")
MIN_SAMPLES = 20
QUANTILES = (0.5, 0.9)


def bucket(prompt_len: int) -> int:
    return max(0, int(math.log2(max(prompt_len, 1))))


def _quantile(sorted_values: list[int], q: float) -> int:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


@dataclass(frozen=True)
class LengthModel:
    """Predicted output tokens from the prompt length: `predict` is the bucket's mean (capped by the request's
    `max_tokens`), `quantile` one of `QUANTILES`."""

    name: str
    buckets: dict[int, dict[str, float]]  # bucket -> {"mean": .., "p50": .., "p90": .., "n": ..}
    overall: dict[str, float]

    def __post_init__(self) -> None:
        if not self.overall or self.overall.get("n", 0) <= 0:
            raise ValueError(f"length model {self.name!r} has no samples")

    def stats(self, prompt_len: int) -> dict[str, float]:
        return self.buckets.get(bucket(prompt_len), self.overall)

    def predict(self, prompt_len: int, max_tokens: int | None = None) -> float:
        """The bucket's mean, capped by the request's `max_tokens` (an output never exceeds it)."""
        mean = self.stats(prompt_len)["mean"]
        return mean if max_tokens is None else min(mean, float(max_tokens))

    def quantile(self, prompt_len: int, q: float) -> float:
        return self.stats(prompt_len)[f"p{round(q * 100)}"]

    @classmethod
    def fit(cls, name: str, rows: list[tuple[int, int]]) -> "LengthModel":
        """`rows`: (prompt tokens, generated tokens) per request."""
        def summary(values: list[int]) -> dict[str, float]:
            values = sorted(values)
            out = {"n": len(values), "mean": round(sum(values) / len(values), 2)}
            out.update({f"p{round(q * 100)}": _quantile(values, q) for q in QUANTILES})
            return out

        groups: dict[int, list[int]] = {}
        for prompt, generated in rows:
            groups.setdefault(bucket(prompt), []).append(generated)
        return cls(name, {b: summary(v) for b, v in sorted(groups.items()) if len(v) >= MIN_SAMPLES},
                   summary([g for _, g in rows]))

    def to_json(self) -> dict:
        return {"buckets": {str(b): s for b, s in self.buckets.items()}, "overall": self.overall}

    @classmethod
    def load(cls, name: str = "all", path: Path = DATA) -> "LengthModel":
        models = json.loads(path.read_text())["models"]
        if name not in models:
            raise ValueError(f"no length model {name!r} in {path} (it has {sorted(models)})")
        m = models[name]
        return cls(name, {int(b): s for b, s in m["buckets"].items()}, m["overall"])


def read_trace(path: Path) -> list[tuple[int, int]]:
    with open(path, newline="") as f:
        return [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="fit the router's output-length model on Azure trace CSVs")
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=DATA)
    args = ap.parse_args(argv)
    traces = {p.stem.rsplit("_", 1)[-1]: read_trace(p) for p in args.traces}
    models = {name: LengthModel.fit(name, rows) for name, rows in traces.items()}
    models["all"] = LengthModel.fit("all", [r for rows in traces.values() for r in rows])
    source = "Azure LLM inference trace 2023 (Splitwise, Patel et al., ISCA 2024), CC BY 4.0: " + \
        ", ".join(p.name for p in args.traces)
    args.out.write_text(json.dumps({"source": source, "models": {n: m.to_json() for n, m in models.items()}}, indent=1)
                        + "\n")


if __name__ == "__main__":
    main()
