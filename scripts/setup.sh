#!/usr/bin/env bash
# Set up everything sandlot needs on this machine. Idempotent; safe to re-run.
#   1. system packages: bubblewrap (the sandbox), libseccomp (its syscall filter),
#      a CJK font (for charts) and chromium with its driver (the web app's tests)
#   2. .venv with sandlot and its dev tools
#   3. the default template (python-data), built once into the cache
#      (/var/cache/sandlot as root, else ~/.cache/sandlot)
#   4. as root: CRIU 4.x (scripts/setup-criu.sh), which sandbox pause, resume,
#      snapshots and fork are built on
#   5. as root: a range of host uids and gids for sandboxes (one pair per live sandbox),
#      delegated to root in /etc/subuid and /etc/subgid, unless root has one already
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

missing=()
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
# libseccomp builds every sandbox's syscall filter (present on most systems already).
compgen -G '/usr/lib/*/libseccomp.so.2' >/dev/null || compgen -G '/lib/*/libseccomp.so.2' >/dev/null \
    || missing+=(libseccomp2)
[ -e /usr/share/fonts/truetype/wqy/wqy-microhei.ttc ] || missing+=(fonts-wqy-microhei)
python3 -m venv --help >/dev/null 2>&1 || missing+=(python3-venv)
# PostgreSQL's server binaries: the server's tests run its audit trail on a throwaway cluster.
compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || missing+=(postgresql)
# A headless browser and its WebDriver: the web app's (/ui) tests drive them.
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
[ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then
        log "installing system packages: ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "sandlot needs: ${missing[*]}. Install them with:" >&2
        echo "    sudo apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
fi

if [ "$(id -u)" -eq 0 ]; then
    bash scripts/setup-criu.sh
elif ! command -v criu >/dev/null 2>&1; then
    echo "note: without CRIU 4.x, sandboxes cannot be paused, snapshotted or forked;" >&2
    echo "      install it with: sudo scripts/setup-criu.sh" >&2
fi

if [ "$(id -u)" -eq 0 ] && ! { grep -qE '^(root|0):' /etc/subuid && grep -qE '^(root|0):' /etc/subgid; } 2>/dev/null; then
    # As root, sandlot starts each sandbox as a host uid of its own (the kernel's per-user
    # quotas, such as inotify instances, are then per sandbox) and refuses to start
    # sandboxes without a delegated range. 100000-165535 is the conventional first range.
    if getent passwd | awk -F: '$3>=100000 && $3<=165535 {found=1} END {exit !found}' \
        || getent group | awk -F: '$3>=100000 && $3<=165535 {found=1} END {exit !found}'; then
        echo "ids 100000-165535 are taken here: delegate another free range to root" >&2
        echo "(usermod --add-subuids FIRST-LAST --add-subgids FIRST-LAST root)" >&2
        exit 1
    fi
    log "delegating host ids 100000-165535 to root for sandboxes (/etc/subuid, /etc/subgid)"
    usermod --add-subuids 100000-165535 --add-subgids 100000-165535 root
fi

if [ ! -x .venv/bin/python ]; then
    log "creating .venv"
    python3 -m venv .venv
fi
log "installing sandlot into .venv"
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 \
    | grep -v -e '^WARNING: Location' -e 'is ignored: it is neither' || true

log "building the python-data template (first time only)"
.venv/bin/sandlot template build python-data
