#!/usr/bin/env bash
# The microvm backend's host pieces, idempotent and offline (only the Debian mirror):
#   * apt: qemu-system-x86 (QEMU 7.2 in bookworm), e2fsprogs
#   * the guest kernel: vmlinuz from Debian's linux-image-cloud-amd64 in bookworm-backports
#     (6.12: tmpfs keeps user.* extended attributes from 6.6, and sandlot stores file
#     metadata in them), downloaded with apt-get download through an apt configuration and
#     state of its own in the cache, and extracted: never installed, and the host's apt
#     sources, lists and packages are untouched (nothing on it comes from backports)
#   * the base initramfs: busybox-static, the virtio drivers that kernel builds as modules
#     (decompressed: busybox's insmod takes plain .ko files) and sandlot's guest init
#     (src/sandlot/backends/microvm/guest-init.sh); the backend appends the runner to it
#     at start, so a change to the runner never rebuilds the disk image
#   * the template's root filesystem, an ext4 image the VM mounts read-only: the same
#     Debian base as the container backends (scripts/setup-docker.sh's package list,
#     built with mmdebstrap, reusing its cached tarball) laid out by the container
#     template build (backends/docker/_image_build.py) with no registry and no engine
# Each artifact is cached in $SANDLOT_CACHE_DIR/microvm (default /var/cache/sandlot as root)
# under a key of its inputs; a run with nothing changed does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=/work/main/.venv/bin/python; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

MIRROR="${SANDLOT_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
KERNEL_PACKAGE="${SANDLOT_VM_KERNEL_PACKAGE:-linux-image-cloud-amd64}"
KERNEL_SUITE="${SANDLOT_VM_KERNEL_SUITE:-bookworm-backports}"
# Kept equal to scripts/setup-docker.sh's BASE_PACKAGES: its cached tarball is reused.
BASE_PACKAGES="python3,python3-venv,python3-numpy,python3-pandas,python3-matplotlib,python3-munkres,\
python3-scipy,python3-seaborn,python3-sklearn,python3-openpyxl,ipython3,fonts-dejavu-core,\
fonts-wqy-microhei,ca-certificates,tini"
CACHE_ROOT="${SANDLOT_CACHE_DIR:-$("$PY" -c 'from sandlot.templates import cache_dir; print(cache_dir())')}"
OUT="$CACHE_ROOT/microvm"
DOCKER_CACHE="${SANDLOT_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/sandlot}/docker"
mkdir -p "$OUT" "$DOCKER_CACHE"

packages=()
command -v qemu-system-x86_64 >/dev/null || packages+=(qemu-system-x86)
command -v mkfs.ext4 >/dev/null || packages+=(e2fsprogs)
command -v mmdebstrap >/dev/null || packages+=(mmdebstrap)
command -v cpio >/dev/null || packages+=(cpio)
command -v xz >/dev/null || packages+=(xz-utils)
if ((${#packages[@]})); then
  log "apt-get install ${packages[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
fi

# --- the kernel and the base initramfs ---------------------------------------------
# The kernel comes from $KERNEL_SUITE through an apt configuration and state of its own
# (in $OUT/apt): it lists that suite only, and neither reads nor writes the host's
# sources, lists, preferences or package status, so the host's apt never sees backports.
kernel_apt_dir="$OUT/apt"
mkdir -p "$kernel_apt_dir"/{lists/partial,cache/archives/partial,sources.list.d,preferences.d}
cat >"$kernel_apt_dir/sources.list.d/kernel.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $KERNEL_SUITE
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
kernel_apt=(-o Dir::Etc::sourcelist=/dev/null -o "Dir::Etc::sourceparts=$kernel_apt_dir/sources.list.d"
  -o Dir::Etc::preferences=/dev/null -o "Dir::Etc::preferencesparts=$kernel_apt_dir/preferences.d"
  -o "Dir::State::Lists=$kernel_apt_dir/lists" -o "Dir::Cache=$kernel_apt_dir/cache"
  -o Dir::State::status=/dev/null)
if ! apt-get "${kernel_apt[@]}" update -qq >"$kernel_apt_dir/update.log" 2>&1; then
  # Offline with lists from an earlier run: they name the kernel the cache was built for.
  compgen -G "$kernel_apt_dir/lists/*_Packages*" >/dev/null \
    || { cat "$kernel_apt_dir/update.log" >&2; echo "cannot fetch $KERNEL_SUITE's package list from $MIRROR" >&2; exit 1; }
  log "cannot refresh $KERNEL_SUITE's package list; using the one from an earlier run"
fi
kernel_deb=$(apt-cache "${kernel_apt[@]}" depends "$KERNEL_PACKAGE" | awk '/Depends: linux-image-/ {print $2; exit}')
[[ -n "$kernel_deb" ]] || { echo "no kernel package behind $KERNEL_PACKAGE in $KERNEL_SUITE" >&2; exit 1; }
busybox_version=$(apt-cache policy busybox-static | awk '/Candidate:/ {print $2}')
init_hash=$(sha256sum src/sandlot/backends/microvm/guest-init.sh | cut -c1-12)
boot_key=$(printf '%s %s %s' "$kernel_deb" "$busybox_version" "$init_hash" | sha256sum | cut -c1-12)
if [[ ! -s "$OUT/vmlinuz-$boot_key" || ! -s "$OUT/initrd-$boot_key.cpio" ]]; then
  log "guest kernel $kernel_deb ($KERNEL_SUITE) and base initramfs (key $boot_key)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get "${kernel_apt[@]}" download -qq "$kernel_deb" 2>/dev/null)
  (cd "$work" && apt-get download -qq busybox-static 2>/dev/null)
  dpkg-deb -x "$work"/linux-image-*.deb "$work/kernel"
  dpkg-deb -x "$work"/busybox-static_*.deb "$work/busybox"
  root="$work/initrd"
  mkdir -p "$root"/{bin,dev,proc,sys,newroot,lib/modules,sandlot-lib}
  cp "$work/busybox/bin/busybox" "$root/bin/busybox"
  for applet in sh mount umount insmod mkdir cp cat switch_root sleep echo ls chown chmod tr ip; do
    ln -s busybox "$root/bin/$applet"
  done
  modules=$(ls -d "$work"/kernel/lib/modules/*)
  # The drivers the guest needs, in dependency order (busybox's insmod resolves none);
  # the guest init loads those listed in load-order. One the kernel builds in is left
  # out; one it has neither way fails here rather than at every boot.
  : >"$root/lib/modules/load-order"
  for m in virtio/virtio_ring virtio/virtio virtio/virtio_pci_modern_dev \
           virtio/virtio_pci_legacy_dev virtio/virtio_pci virtio/virtio_mmio \
           block/virtio_blk char/virtio_console; do
    ko="$modules/kernel/drivers/$m.ko"
    grep -qx "kernel/drivers/$m.ko" "$modules/modules.builtin" && continue
    if [[ -f "$ko" ]]; then
      cp "$ko" "$root/lib/modules/"
    elif [[ -f "$ko.xz" ]]; then
      xz -dc "$ko.xz" >"$root/lib/modules/${m##*/}.ko"
    else
      echo "the guest kernel $kernel_deb has no ${m##*/} driver, built in or as a module" >&2
      exit 1
    fi
    echo "${m##*/}" >>"$root/lib/modules/load-order"
  done
  install -m 0755 src/sandlot/backends/microvm/guest-init.sh "$root/init"
  (cd "$root" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet --owner 0:0) \
    >"$OUT/initrd-$boot_key.cpio.tmp"
  cp "$work"/kernel/boot/vmlinuz-* "$OUT/vmlinuz-$boot_key.tmp"
  mv "$OUT/initrd-$boot_key.cpio.tmp" "$OUT/initrd-$boot_key.cpio"
  mv "$OUT/vmlinuz-$boot_key.tmp" "$OUT/vmlinuz-$boot_key"
  rm -rf "$work"
  trap - EXIT
fi

# --- the root filesystem -------------------------------------------------------------
base_key=$(printf '%s %s' "$BASE_PACKAGES" "$MIRROR" | sha256sum | cut -c1-12)
tarball="$DOCKER_CACHE/base-bookworm-$base_key.tar"
config=$("$PY" -c 'import json; from sandlot.backends.docker._image import build_config; print(json.dumps(build_config("python-data"), sort_keys=True))')
build_hash=$(sha256sum src/sandlot/backends/docker/_image_build.py | cut -c1-12)
image_key=$(printf '%s %s %s' "$base_key" "$config" "$build_hash" | sha256sum | cut -c1-12)
image="$OUT/rootfs-python-data-$image_key.ext4"
if [[ ! -s "$image" ]]; then
  if [[ ! -s "$tarball" ]]; then
    log "building the base root filesystem with mmdebstrap (once; cached in $tarball)"
    rm -rf "$tarball.tmp"
    nice mmdebstrap --variant=minbase --format=tar --include="$BASE_PACKAGES" \
      --aptopt='APT::Install-Recommends "false"' \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      bookworm "$tarball.tmp" "$MIRROR" >"$DOCKER_CACHE/mmdebstrap.log" 2>&1 \
      || { tail -30 "$DOCKER_CACHE/mmdebstrap.log"; exit 1; }
    mv "$tarball.tmp" "$tarball"
  fi
  log "laying out the python-data root filesystem image (key $image_key)"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  mkdir "$work/root"
  tar -xf "$tarball" -C "$work/root"
  mkdir -p "$work/root/sandlot-build"
  cp src/sandlot/backends/docker/_image_build.py "$work/root/sandlot-build/build.py"
  # The container template build, in a chroot with its own mount namespace (for /proc).
  nice unshare --mount --fork sh -c '
    mount -t proc proc "$1/proc" && mount -t tmpfs tmpfs "$1/tmp" &&
    chroot "$1" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root python3 /sandlot-build/build.py "$2"
  ' - "$work/root" "$config" >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  rm -rf "$work/root/sandlot-build"
  # Mount points the guest init fills (tmpfs, the runner) and the channel it opens.
  mkdir -p "$work/root"/{proc,sys,dev,tmp,home/user,opt/sandlot/lib}
  size_mb=$(( $(du -sm "$work/root" | cut -f1) * 115 / 100 + 64 ))
  rm -f "$image.tmp"
  nice mkfs.ext4 -q -F -L sandlot-root -O ^has_journal -m 0 -d "$work/root" "$image.tmp" "${size_mb}M"
  mv "$image.tmp" "$image"
  rm -rf "$work"
  trap - EXIT
fi

# What the backend reads to find its artifacts (written last: a partial run leaves none).
cat >"$OUT/microvm.json.tmp" <<EOF
{"kernel": "vmlinuz-$boot_key", "initrd": "initrd-$boot_key.cpio",
 "images": {"python-data": "rootfs-python-data-$image_key.ext4"},
 "kernel_package": "$kernel_deb"}
EOF
mv "$OUT/microvm.json.tmp" "$OUT/microvm.json"
# Artifacts of older keys go (each image is over a gigabyte).
find "$OUT" -maxdepth 1 -type f \( -name 'vmlinuz-*' -o -name 'initrd-*' -o -name 'rootfs-*' \) \
  ! -name "vmlinuz-$boot_key" ! -name "initrd-$boot_key.cpio" ! -name "rootfs-python-data-$image_key.ext4" \
  -delete
log "microvm artifacts ready in $OUT"
