#!/usr/bin/env bash
# Set up, then run every check CI runs: formatting, lint, types, and the test
# suite against the real bubblewrap, Docker (runc and gVisor), Podman and microVM (QEMU)
# backends (a missing backend fails, not skips).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-docker.sh
bash scripts/setup-vm.sh
log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
log "ruff"
.venv/bin/ruff format --check src tests examples
.venv/bin/ruff check src tests examples
log "mypy"
.venv/bin/mypy
log "import layers"
.venv/bin/lint-imports
log "pytest"
SANDLOT_REQUIRE="bwrap,template,docker,runsc,podman,microvm,server,postgres,browser,ray" .venv/bin/python -m pytest "$@"
if [ "$(id -u)" -eq 0 ]; then
    # Root covered above; sandlot must also hold when run by an ordinary user.
    log "escape suite as an unprivileged user"
    bash scripts/test-as-user.sh -q
fi
