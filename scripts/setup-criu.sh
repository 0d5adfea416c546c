#!/usr/bin/env bash
# Install CRIU 4.x (checkpoint/restore: what sandbox pause, resume, snapshots and fork
# are built on) as /usr/local/sbin/criu. Idempotent; needs root; called by setup.sh.
#
# Debian 12 packages CRIU 3.17, which fails `criu check` on current kernels (its vDSO
# handling); Debian 13 (trixie) has 4.1.x. This builds the binary from trixie's source
# package: the upstream tarball named in trixie's signed Sources index, its SHA-256
# checked against that index, compiled against this system's own libraries. apt's view
# of the host is left as it was: the trixie index lives in a throwaway directory.
set -euo pipefail

log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

PREFIX=/usr/local/sbin
if [ -x "$PREFIX/criu" ] && "$PREFIX/criu" --version 2>/dev/null | grep -qE '^Version: [4-9]\.'; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "CRIU 4.x is needed for pause, resume, snapshots and fork; run as root: $0" >&2
    exit 1
fi

log "building CRIU 4.x from Debian trixie's source package (pause, resume, snapshots, fork)"
deps=(libbsd-dev libcap-dev libgnutls28-dev libnet1-dev libnftables-dev libnl-3-dev
    libprotobuf-c-dev libprotobuf-dev pkgconf protobuf-c-compiler protobuf-compiler
    uuid-dev iproute2 curl make gcc)
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${deps[@]}" >/dev/null

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial"
cat > "$work/sources.list" <<'EOF'
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main
EOF
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "APT::Sandbox::User=root")
apt-get "${apt_opts[@]}" update -qq
record=$(apt-cache "${apt_opts[@]}" showsrc criu)
version=$(awk '/^Version:/ {print $2; exit}' <<<"$record")
directory=$(awk '/^Directory:/ {print $2; exit}' <<<"$record")
upstream=${version%-*}
tarball="criu_${upstream}.orig.tar.xz"
sha=$(awk -v f="$tarball" '/^Checksums-Sha256:/ {on=1; next} /^[^ ]/ {on=0} on && $3 == f {print $1; exit}' <<<"$record")
case "$upstream" in
    4.*) ;;
    *) echo "trixie's CRIU is $version; sandlot needs 4.x" >&2; exit 1 ;;
esac
if [ -z "$sha" ] || [ -z "$directory" ]; then
    echo "trixie's Sources index names no $tarball" >&2
    exit 1
fi
curl -fsSL --retry 3 -o "$work/$tarball" "http://deb.debian.org/debian/$directory/$tarball"
echo "$sha  $work/$tarball" | sha256sum -c --quiet -
tar -xf "$work/$tarball" -C "$work"
make -C "$work/criu-$upstream" -j"$(nproc)" criu >"$work/build.log" 2>&1 || {
    tail -30 "$work/build.log" >&2
    exit 1
}
install -m 0755 "$work/criu-$upstream/criu/criu" "$PREFIX/criu"
"$PREFIX/criu" check >/dev/null 2>&1 || {
    echo "CRIU $upstream is installed but \`criu check\` fails on this kernel:" >&2
    "$PREFIX/criu" check >&2 || true
    exit 1
}
log "CRIU $upstream installed at $PREFIX/criu"
