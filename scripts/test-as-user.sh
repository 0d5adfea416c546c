#!/usr/bin/env bash
# Run the escape suite and the whole-sandbox limit tests as an ordinary, unprivileged user.
#
# sandlot supports two ways of running: as root (each sandbox then runs as a host uid of
# its own, from the range delegated in /etc/subuid) and as a normal user on a host that
# allows unprivileged user namespaces. The main test run covers root; this covers the
# other. Must be started as root, because it creates the user and gives it what a host
# administrator would: a delegated cgroup subtree (SANDLOT_CGROUP_ROOT) so its sandboxes
# get exact limits too.
#
# The user gets its own copy of the checkout and its own venv (a checkout under /root is
# not readable by other users), and reads the root-built template from the shared cache.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

USER_NAME=sandlot-ci
CGROUP_NAME=sandlot-ci
[ "$(id -u)" -eq 0 ] || { echo "run as root (it creates the test user)" >&2; exit 1; }

id "$USER_NAME" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$USER_NAME"
HOME_DIR=$(getent passwd "$USER_NAME" | cut -d: -f6)

log "delegating a cgroup subtree to $USER_NAME"
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    # cgroup v2: a child of the root with the controllers enabled, owned by the user.
    base=/sys/fs/cgroup/$CGROUP_NAME
    echo "+memory +pids +cpu" > /sys/fs/cgroup/cgroup.subtree_control
    mkdir -p "$base"
    chown -R "$USER_NAME" "$base"
else
    # cgroup v1: the same relative directory under each controller's hierarchy.
    for ctrl in memory pids cpu cpuacct; do
        [ -d "/sys/fs/cgroup/$ctrl" ] || continue
        mkdir -p "/sys/fs/cgroup/$ctrl/$CGROUP_NAME"
        chown -R "$USER_NAME" "/sys/fs/cgroup/$ctrl/$CGROUP_NAME"
    done
fi

log "copying the checkout for $USER_NAME"
WORK="$HOME_DIR/sandlot"
rm -rf "$WORK"
mkdir -p "$WORK"
git ls-files -z | xargs -0 cp --parents -t "$WORK"
chown -R "$USER_NAME" "$WORK"

run_as_user() {
    # A clean login environment, plus what the tests need to know. Only bwrap: the
    # container backends are root's engines (their sockets), covered by the root run.
    su - "$USER_NAME" -c "cd '$WORK' && export SANDLOT_CGROUP_ROOT='$CGROUP_NAME' \
        SANDLOT_CACHE_DIR=/var/cache/sandlot SANDLOT_REQUIRE=bwrap,template \
        SANDLOT_BACKENDS=bwrap && $1"
}

log "venv for $USER_NAME"
run_as_user "python3 -m venv .venv && .venv/bin/python -m pip install -q \
    --disable-pip-version-check -e . pytest pytest-timeout 2>&1 \
    | grep -v -e '^WARNING: Location' -e 'is ignored: it is neither' || true"

log "doctor, as $USER_NAME"
run_as_user ".venv/bin/sandlot doctor"
log "escape suite and limits, as $USER_NAME"
run_as_user ".venv/bin/python -m pytest -p no:cacheprovider tests/escape \
    tests/integration/test_limits.py tests/integration/test_fail_closed.py \
    tests/integration/test_zygote.py $*"
