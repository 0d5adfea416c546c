#!/usr/bin/env bash
# Run E2B's own Python test suites, unmodified, against a fresh `sandlot serve` in
# E2B's normal mode. Not part of CI (it needs clones of E2B's repositories).
#
#   scripts/e2b-suites.sh CODE_INTERPRETER_REPO E2B_REPO [WORK_DIR]
#
# The two repositories are clones (or bare git dirs) of github.com/e2b-dev/code-interpreter
# and github.com/e2b-dev/E2B; their tests are extracted at HEAD (set REV_CI / REV_E2B to
# pick other revisions) into WORK_DIR (default: a new temporary directory), never into
# this repository. The clients under test are the `e2b` and `e2b-code-interpreter`
# packages installed next to sandlot (PYTHON, default: python3 on PATH); the suites'
# test-only plugins (pytest-asyncio) go into an overlay venv in WORK_DIR, so that
# environment is left as it was. Results: WORK_DIR/*.log and a summary on stdout.
# PYTEST_K="watch or charts" runs only the tests that pytest's -k expression selects;
# SERVE_ARGS="--checkpointable" starts the server so that pause, snapshots and fork work.
# docs/e2b.md says which tests are expected to fail, and why.
set -euo pipefail

if [[ $# -lt 2 ]]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
CI_REPO=$1
E2B_REPO=$2
WORK=${3:-$(mktemp -d -t sandlot-e2b-suites.XXXXXX)}
PYTHON=${PYTHON:-python3}
TIMEOUT=${TEST_TIMEOUT:-60}
WORKERS=${WORKERS:-2}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)

git_dir() { git -C "$1" rev-parse --absolute-git-dir; }

echo "==> extracting the suites into $WORK"
rm -rf "$WORK/ci" "$WORK/e2b"
mkdir -p "$WORK/ci" "$WORK/e2b"
# Only the tests and their pytest.ini: the packages' own sources must not shadow the
# installed clients.
git --git-dir="$(git_dir "$CI_REPO")" archive "${REV_CI:-HEAD}" python/tests python/pytest.ini |
    tar -x -C "$WORK/ci" --strip-components=1
git --git-dir="$(git_dir "$E2B_REPO")" archive "${REV_E2B:-HEAD}" \
    packages/python-sdk/tests packages/python-sdk/pytest.ini |
    tar -x -C "$WORK/e2b" --strip-components=2

echo "==> test environment (overlay venv on $PYTHON)"
if [[ ! -x "$WORK/venv/bin/python" ]]; then
    "$PYTHON" -m venv "$WORK/venv"
    # addsitedir, not a bare path: the base environment's own .pth files (an editable
    # sandlot) must be read too.
    "$PYTHON" -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_paths()["purelib"])' \
        >"$WORK/venv/lib/$("$WORK/venv/bin/python" -c 'import sys; print(f"python{sys.version_info[0]}.{sys.version_info[1]}")')/site-packages/base-env.pth"
fi
VPY=$WORK/venv/bin/python
"$VPY" -c 'import pytest_asyncio' 2>/dev/null || "$VPY" -m pip install -q 'pytest-asyncio>=1.3,<2'
"$VPY" -c 'import pytest_timeout, xdist' 2>/dev/null ||
    "$VPY" -m pip install -q 'pytest-timeout>=2.4' 'pytest-xdist>=3.6'
"$VPY" -c 'import e2b, e2b_code_interpreter, sandlot' # the clients and the server

echo "==> starting sandlot serve"
export SANDLOT_SERVER_DIR=$WORK/server
mkdir -p "$SANDLOT_SERVER_DIR"
KEY=$("$VPY" -m sandlot keys create --tenant e2b-suites --max-sandboxes 40 \
    --creates-per-minute 600 | tail -1)
# shellcheck disable=SC2086 # SERVE_ARGS: extra words for sandlot serve (--checkpointable)
"$VPY" -m sandlot serve --host 127.0.0.1 --port 0 ${SERVE_ARGS:-} >"$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null || true' EXIT
URL=
for _ in $(seq 1 120); do
    URL=$(grep -o 'Uvicorn running on http://127.0.0.1:[0-9]*' "$WORK/server.log" | grep -o 'http://.*' || true)
    [[ -n $URL ]] && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log"; exit 1; }
    sleep 0.5
done
[[ -n $URL ]] || { echo "the server did not start"; cat "$WORK/server.log"; exit 1; }
echo "    $URL"

export E2B_API_URL=$URL E2B_SANDBOX_URL=$URL E2B_API_KEY=$KEY
unset E2B_DEBUG E2B_DOMAIN E2B_ACCESS_TOKEN

run() { # NAME DIR PATHS...
    local name=$1 dir=$2
    shift 2
    echo "==> $name"
    (cd "$dir" && nice "$VPY" -m pytest -p no:cacheprovider -o addopts=--import-mode=importlib \
        -n "$WORKERS" --timeout="$TIMEOUT" -q -rfE ${PYTEST_K:+-k "$PYTEST_K"} "$@" \
        >"$WORK/$name.log" 2>&1) || true
    tail -1 "$WORK/$name.log"
}
run code-interpreter "$WORK/ci" tests
run python-sdk-sync "$WORK/e2b" tests/sync/sandbox_sync tests/sync/api_sync
run python-sdk-async "$WORK/e2b" tests/async/sandbox_async tests/async/api_async

echo "==> failures (the logs are in $WORK)"
grep -h '^FAILED' "$WORK"/code-interpreter.log "$WORK"/python-sdk-*.log | sed 's/ - .*//' | sort
