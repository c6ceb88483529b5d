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
# One run per machine at a time: runs share the venvs under the cache. -o: the lock
# is not inherited, so a process a test leaves behind cannot hold it.
LOCK="$SPYRE_INFERENCE_CACHE/locks/test-run.lock"
flock -n -o "$LOCK" true || spyre_log "waiting for another run on this machine ($LOCK)"
exec flock -o "$LOCK" "$BOOT_VENV/bin/nox" --noxfile "$ROOT/noxfile.py" --envdir "$SPYRE_INFERENCE_CACHE/nox/.nox" "$@"
