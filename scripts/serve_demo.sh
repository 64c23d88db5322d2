#!/usr/bin/env bash
# Starts `kvflow serve` (default: the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000; extra
# arguments go to `kvflow serve`, e.g. --mode disaggregated), waits until /health answers, sends one
# chat completion with streaming, prints the reply as it streams, and stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8000}
.venv/bin/kvflow serve --port "$PORT" --log-level warning "$@" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
# The first start compiles the CPU kernels and converts the model (a minute or more; kvflow serve says
# so on stderr), so the wait is for as long as the server runs, not a fixed time: it either answers
# /health or exits (a busy port, a bad flag: at once, with one line saying why).
while kill -0 $SERVER 2>/dev/null; do
  if curl -fs "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then break; fi
  sleep 0.5
done
kill -0 $SERVER 2>/dev/null || { echo "kvflow serve exited" >&2; exit 1; }
.venv/bin/python - "$PORT" <<'PY'
import sys
import openai

client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="unused")
model = client.models.list().data[0].id
question = "What is the capital of France? Answer in one sentence."
print(f"> {question}")
stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                        max_tokens=64, temperature=0, stream=True)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()
PY
