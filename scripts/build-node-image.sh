#!/usr/bin/env bash
# The sandlot node image: one image for every pod of a sandlot Ray cluster (the head with
# the front door, `sandlot serve --ray`, and the workers that hold sandboxes). Built offline,
# as scripts/setup-vm.sh builds the microvm's root filesystem: no image registry, only
# the Debian mirror and the Python package index.
#   * the Debian base of the container backends (scripts/setup-docker.sh's package list,
#     its cached mmdebstrap tarball), extracted and finished in a chroot:
#   * apt: bubblewrap (the sandbox), wget (KubeRay's exec probes on older Ray), procps
#   * /opt/sandlot: a venv with sandlot[ray,server,postgres] from this checkout's wheel and
#     ray[default] (the dashboard agent KubeRay's probes ask), first on PATH
#   * the python-data template built into /var/cache/sandlot (sandlot's cache for root)
#   * host ids 100000-165535 delegated to root (/etc/subuid, /etc/subgid): one per sandbox
#   * /usr/local/bin/sandlot-node-prepare (deploy/node/): the cgroup set-up before `ray start`
# then imported into the engine (`docker import` / `podman import`) with its config.
# The package downloads go through the host's uv cache, so a rebuild after a change to
# sandlot's source reinstalls from that cache, not the network.
#
# Usage: scripts/build-node-image.sh [--engine docker|podman] [--tag NAME] [--force]
# Prints the image name. Needs root (chroot, mount namespace). Reuses an image whose
# label org.sandlot.node-key matches the inputs (base, this script, sandlot's source, Ray).
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

ENGINE=docker
TAG="sandlot/node:latest"
FORCE=0
while (($#)); do
  case "$1" in
    --engine) ENGINE="$2"; shift 2 ;;
    --tag) TAG="$2"; shift 2 ;;
    --force) FORCE=1; shift ;;
    *) echo "usage: $0 [--engine docker|podman] [--tag NAME] [--force]" >&2; exit 2 ;;
  esac
done
case "$ENGINE" in docker | podman) ;; *) echo "--engine must be docker or podman" >&2; exit 2 ;; esac
[[ "$(id -u)" -eq 0 ]] || { echo "$0 needs root (it builds the root filesystem in a chroot)" >&2; exit 1; }
command -v "$ENGINE" >/dev/null || { echo "$ENGINE is not installed (scripts/setup-docker.sh)" >&2; exit 1; }

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=/work/main/.venv/bin/python; fi
fi
UV=$("$PY" -c 'import uv; print(uv.find_uv_bin())')
# Ray on every node of a cluster must be the same version: the manifests in deploy/kuberay
# name this one (spec.rayVersion), and tests/deploy checks that they agree.
RAY_VERSION="${SANDLOT_NODE_RAY_VERSION:-2.60.0}"
MIRROR="${SANDLOT_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# Kept equal to scripts/setup-docker.sh's BASE_PACKAGES: its cached tarball is reused.
BASE_PACKAGES="python3,python3-venv,python3-numpy,python3-pandas,python3-matplotlib,python3-munkres,\
python3-scipy,python3-seaborn,python3-sklearn,python3-openpyxl,ipython3,fonts-dejavu-core,\
fonts-wqy-microhei,ca-certificates,tini"
NODE_PACKAGES="bubblewrap wget procps"
DOCKER_CACHE="${SANDLOT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sandlot}/docker"
UV_CACHE="${UV_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/uv}"
mkdir -p "$DOCKER_CACHE" "$UV_CACHE"

base_key=$(printf '%s %s' "$BASE_PACKAGES" "$MIRROR" | sha256sum | cut -c1-12)
tarball="$DOCKER_CACHE/base-bookworm-$base_key.tar"
source_key=$(git ls-files -co --exclude-standard -z src pyproject.toml | LC_ALL=C sort -z \
  | xargs -0 sha256sum | sha256sum | cut -c1-12)
key=$(printf '%s %s %s %s %s' "$base_key" "$NODE_PACKAGES" "$RAY_VERSION" "$source_key" \
  "$(cat scripts/build-node-image.sh deploy/node/sandlot-node-prepare | sha256sum | cut -c1-12)" \
  | sha256sum | cut -c1-12)
have=$("$ENGINE" image inspect --format '{{index .Config.Labels "org.sandlot.node-key"}}' "$TAG" 2>/dev/null || true)
if [[ "$have" == "$key" && "$FORCE" -eq 0 ]]; then
  log "$TAG is current (key $key)"
  echo "$TAG"
  exit 0
fi

if [[ ! -s "$tarball" ]]; then
  command -v mmdebstrap >/dev/null || { echo "mmdebstrap is missing (apt-get install mmdebstrap)" >&2; exit 1; }
  log "building the base root filesystem with mmdebstrap (once; cached in $tarball)"
  rm -rf "$tarball.tmp"
  nice mmdebstrap --variant=minbase --format=tar --include="$BASE_PACKAGES" \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    bookworm "$tarball.tmp" "$MIRROR" >"$DOCKER_CACHE/mmdebstrap.log" 2>&1 \
    || { tail -30 "$DOCKER_CACHE/mmdebstrap.log"; exit 1; }
  mv "$tarball.tmp" "$tarball"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/sandlot-node-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
log "sandlot wheel from this checkout"
"$UV" build --quiet --wheel --out-dir "$work/wheel" . >&2
wheel=$(cd "$work/wheel" && ls sandlot-*.whl)

log "root filesystem (key $key)"
root="$work/root"
mkdir "$root"
tar -xf "$tarball" -C "$root"
mkdir -p "$root/sandlot-build/wheel" "$root/sandlot-build/uv-cache"
# The host's CA bundle, for the build only: a host that reaches the package index through
# a TLS-inspecting proxy trusts that proxy's CA there, and Debian's bundle does not.
CA_FILE="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
cp "$CA_FILE" "$root/sandlot-build/ca.crt"
cp "$work/wheel/$wheel" "$root/sandlot-build/wheel/"
cp "$UV" "$root/sandlot-build/uv"
install -m 0755 deploy/node/sandlot-node-prepare "$root/usr/local/bin/sandlot-node-prepare"
cat >"$root/sandlot-build/build.sh" <<EOF
set -eu
export DEBIAN_FRONTEND=noninteractive UV_CACHE_DIR=/sandlot-build/uv-cache UV_LINK_MODE=copy
export SSL_CERT_FILE=/sandlot-build/ca.crt
apt-get -o DPkg::Lock::Timeout=600 update -qq
apt-get install -y -qq --no-install-recommends $NODE_PACKAGES >/dev/null
apt-get clean
rm -rf /var/lib/apt/lists/*
/sandlot-build/uv venv --quiet --python /usr/bin/python3 /opt/sandlot
/sandlot-build/uv pip install --quiet --python /opt/sandlot/bin/python --compile-bytecode \
  "/sandlot-build/wheel/$wheel[ray,server,postgres]" "ray[default]==$RAY_VERSION"
# A login shell (KubeRay starts Ray with bash -lc) sets PATH from /etc/profile: put the
# venv first there too (a link to its python would not find the venv's pyvenv.cfg).
echo 'export PATH=/opt/sandlot/bin:\$PATH' >/etc/profile.d/sandlot.sh
/opt/sandlot/bin/sandlot template build python-data
printf 'root:100000:65536\n' >/etc/subuid
printf 'root:100000:65536\n' >/etc/subgid
EOF
# In a mount namespace of its own: /proc and /tmp for the build, the host's name server
# for apt and uv, and the host's uv cache so unchanged packages are not downloaded again.
nice unshare --mount --fork sh -c '
  set -e
  mount -t proc proc "$1/proc"
  mount -t tmpfs tmpfs "$1/tmp"
  mount --bind "$2" "$1/sandlot-build/uv-cache"
  touch "$1/etc/resolv.conf" && mount --bind /etc/resolv.conf "$1/etc/resolv.conf"
  chroot "$1" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root sh /sandlot-build/build.sh
' - "$root" "$UV_CACHE" >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; exit 1; }
rm -rf "$root/sandlot-build"
: >"$root/etc/resolv.conf"

# The image the tag named until now goes once the new one has it (each is ~2.4 GB); one
# that a container still uses stays, the engine refuses to remove it.
old_id=$("$ENGINE" image inspect --format '{{.Id}}' "$TAG" 2>/dev/null || true)
log "$ENGINE import as $TAG"
tar -C "$root" --numeric-owner -c . | "$ENGINE" import \
  --change "LABEL org.sandlot.node-key=$key" \
  --change "LABEL org.sandlot.ray-version=$RAY_VERSION" \
  --change 'ENV PATH=/opt/sandlot/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'WORKDIR /root' \
  --change 'CMD ["/bin/bash"]' \
  - "$TAG" >/dev/null
if [[ -n "$old_id" ]]; then "$ENGINE" image rm "$old_id" >/dev/null 2>&1 || true; fi
echo "$TAG"
