# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/serve.sh: finds Python 3.11+ and makes the
# small bootstrap venv (nox, uv, hatchling; pinned) once per machine under the cache dir.
#
# Sets and exports: SPYRE_INFERENCE_CACHE, SPYRE_INFERENCE_PYTHON (the real
# interpreter new venvs are made from), BOOT_VENV; puts BOOT_VENV/bin on PATH.

# nox runs the sessions, uv installs (tools/spyre_env.py), hatchling builds the
# project's wheels without an isolated build env (2.6 s -> 0.6 s per wheel here).
BOOT_REQUIREMENTS="nox==2026.10.20 uv==0.13.9 hatchling==1.33.0"

spyre_log() { printf '[spyre] %s\n' "$*" >&2; }

spyre_find_python() {
    local candidate
    for candidate in "${SPYRE_INFERENCE_PYTHON:-}" python3.11 python3 python; do
        [ -n "$candidate" ] || continue
        command -v "$candidate" >/dev/null 2>&1 || continue
        if "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            # The real interpreter, not a pyenv shim: venvs must not depend on shims.
            "$candidate" -c 'import sys; print(sys.executable)'
            return 0
        fi
    done
    spyre_log "no Python >= 3.11 found (tried \$SPYRE_INFERENCE_PYTHON, python3.11, python3, python)"
    return 1
}

# pip warns once per package about the machine's extra file:// indexes that lack it;
# drop that noise, keep everything else (and pip's exit status).
spyre_quiet_pip() {
    local rc=0
    "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2) || rc=$?
    return "$rc"
}

spyre_bootstrap() {
    SPYRE_INFERENCE_CACHE="${SPYRE_INFERENCE_CACHE:-$HOME/.cache/spyre-inference}"
    mkdir -p "$SPYRE_INFERENCE_CACHE/locks" "$SPYRE_INFERENCE_CACHE/bootstrap"
    SPYRE_INFERENCE_CACHE="$(cd "$SPYRE_INFERENCE_CACHE" && pwd)"
    SPYRE_INFERENCE_PYTHON="$(spyre_find_python)"
    local tag
    tag="$("$SPYRE_INFERENCE_PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
    local reqs_hash
    reqs_hash="$(printf '%s' "$BOOT_REQUIREMENTS" | sha256sum | cut -c1-12)"
    BOOT_VENV="$SPYRE_INFERENCE_CACHE/bootstrap/$tag-$reqs_hash"
    if [ ! -f "$BOOT_VENV/.complete" ]; then
        (
            flock 9
            if [ ! -f "$BOOT_VENV/.complete" ]; then
                spyre_log "creating the bootstrap venv $BOOT_VENV ($BOOT_REQUIREMENTS)"
                rm -rf "$BOOT_VENV"
                "$SPYRE_INFERENCE_PYTHON" -m venv "$BOOT_VENV"
                # shellcheck disable=SC2086  # word splitting intended
                spyre_quiet_pip "$BOOT_VENV/bin/python" -m pip install -q $BOOT_REQUIREMENTS
                touch "$BOOT_VENV/.complete"
            fi
        ) 9>"$SPYRE_INFERENCE_CACHE/locks/bootstrap.lock"
    fi
    export SPYRE_INFERENCE_CACHE SPYRE_INFERENCE_PYTHON BOOT_VENV
    export PATH="$BOOT_VENV/bin:$PATH"
}
