#!/usr/bin/env bash
# Container engines for sandlot's docker and podman backends, idempotent and offline:
#   * apt: docker.io, podman, runsc (gVisor), mmdebstrap
#   * dockerd running with runsc registered as a runtime (ptrace platform)
#   * podman's Docker-compatible API on /run/podman/podman.sock
#   * the base image sandlot/base:bookworm, built from the Debian mirror with mmdebstrap
#     (no image registry is needed), cached as a tarball keyed by its package list
#   * the python-data template image on top of it (`sandlot template build --backend docker`)
# Called by scripts/test.sh; safe to run again (each step checks before it acts).
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

BASE_IMAGE="${SANDLOT_DOCKER_BASE:-sandlot/base:bookworm}"
CACHE="${SANDLOT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sandlot}/docker"
MIRROR="${SANDLOT_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# What the template needs from Debian instead of PyPI. python3-munkres: without it apt
# satisfies a recommends chain of numpy/matplotlib with a compiler toolchain.
BASE_PACKAGES="python3,python3-venv,python3-numpy,python3-pandas,python3-matplotlib,python3-munkres,\
python3-scipy,python3-seaborn,python3-sklearn,python3-openpyxl,ipython3,fonts-dejavu-core,\
fonts-wqy-microhei,ca-certificates,tini"

packages=()
command -v dockerd >/dev/null || packages+=(docker.io)
command -v podman >/dev/null || packages+=(podman)
command -v runsc >/dev/null || packages+=(runsc)
command -v mmdebstrap >/dev/null || packages+=(mmdebstrap)
if ((${#packages[@]})); then
  log "apt-get install ${packages[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi

# dockerd: runsc in its ptrace platform works without KVM and inside VMs.
mkdir -p /etc/docker
want='{
  "runtimes": {"runsc": {"path": "'"$(command -v runsc)"'", "runtimeArgs": ["--platform=ptrace", "--network=none", "--oci-seccomp"]}}
}'
restart=0
if [[ ! -f /etc/docker/daemon.json ]] || [[ "$(cat /etc/docker/daemon.json)" != "$want" ]]; then
  printf '%s\n' "$want" >/etc/docker/daemon.json
  restart=1
fi
if ! docker info >/dev/null 2>&1 || ((restart)); then
  if [[ -f /run/docker.pid ]] && kill -0 "$(cat /run/docker.pid)" 2>/dev/null; then
    log "reloading dockerd (runtimes changed)"
    kill -HUP "$(cat /run/docker.pid)"
    sleep 1
  else
    log "starting dockerd"
    # Started from / (not this checkout): an engine's working directory is where its
    # helpers may drop files, and the test suite checks the repository root stays clean.
    (cd / && nohup dockerd >/var/log/sandlot-dockerd.log 2>&1 &)
  fi
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null || { tail -20 /var/log/sandlot-dockerd.log; exit 1; }
fi

# podman's Docker-compatible API (the podman backend talks to it like to dockerd).
if ! timeout 10 podman --url unix:///run/podman/podman.sock version >/dev/null 2>&1; then
  log "starting podman system service"
  mkdir -p /run/podman
  # From its own directory: conmon writes an empty file named "oom" into the service's
  # working directory when a container is OOM-killed (it appeared at the repository root).
  (cd /run/podman && nohup podman system service --time=0 unix:///run/podman/podman.sock \
      >/var/log/sandlot-podman.log 2>&1 &)
  for _ in $(seq 1 60); do
    timeout 10 podman --url unix:///run/podman/podman.sock version >/dev/null 2>&1 && break
    sleep 0.5
  done
fi

# The base image, offline: a Debian root filesystem from the mirror, imported.
key=$(printf '%s %s' "$BASE_PACKAGES" "$MIRROR" | sha256sum | cut -c1-12)
tarball="$CACHE/base-bookworm-$key.tar"
mkdir -p "$CACHE"
if [[ ! -s "$tarball" ]]; then
  log "building the base root filesystem with mmdebstrap (once; cached in $tarball)"
  rm -rf "$tarball.tmp"
  mmdebstrap --variant=minbase --format=tar --include="$BASE_PACKAGES" --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    bookworm "$tarball.tmp" "$MIRROR" >"$CACHE/mmdebstrap.log" 2>&1 || { tail -30 "$CACHE/mmdebstrap.log"; exit 1; }
  mv "$tarball.tmp" "$tarball"
fi
for engine in docker podman; do
  command -v "$engine" >/dev/null || continue
  have=$("$engine" image inspect --format '{{index .Config.Labels "org.sandlot.base-key"}}' "$BASE_IMAGE" 2>/dev/null || true)
  if [[ "$have" != "$key" ]]; then
    log "$engine import $tarball as $BASE_IMAGE"
    "$engine" import --change "LABEL org.sandlot.base-key=$key" --change 'CMD ["/bin/bash"]' "$tarball" "$BASE_IMAGE" >/dev/null
  fi
done

# The template images (reused when base, recipe and build script are unchanged).
if [[ -x .venv/bin/sandlot ]]; then
  for engine in docker podman; do
    command -v "$engine" >/dev/null || continue
    .venv/bin/sandlot template build --backend "$engine" --base "$BASE_IMAGE" >/dev/null
  done
fi
