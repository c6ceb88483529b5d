#!/usr/bin/env bash
# Run the whole test-suite: every nox session CI needs (lint, each package alone,
# end to end). Arguments go to nox, e.g.:
#   scripts/test.sh                      # everything (the `test` umbrella session)
#   scripts/test.sh -s ops               # one session
#   scripts/test.sh -s e2e -- -k serve   # pytest arguments after --
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/_bootstrap.sh
source "$ROOT/scripts/_bootstrap.sh"
spyre_bootstrap
cd "$ROOT"
# The vLLM wheel is built (once per machine) before nox starts, so its log is not
# interleaved with a session's.
"$BOOT_VENV/bin/python" "$ROOT/tools/spyre_env.py" vllm >/dev/null
exec "$BOOT_VENV/bin/nox" --noxfile "$ROOT/noxfile.py" --envdir "$SPYRE_INFERENCE_CACHE/nox/.nox" "$@"
