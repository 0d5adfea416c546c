#!/bin/sh
# sandlot's microvm guest init (pid 1 of the initramfs; busybox sh). It loads the virtio
# drivers, mounts the template's root filesystem read-only, gives the sandbox its
# writable tmpfs mounts (/home/user and /tmp, sized by the kernel command line), copies
# in the runner (appended to the initramfs by the host at start), and execs the runner
# as the guest's pid 1, as uid 1000, speaking the protocol on the virtio-serial port.
# Any failure powers the VM off (panic=-1 with QEMU's -no-reboot): the host sees the
# sandbox exit before "ready" and refuses it with the console's last lines.
export PATH=/bin
fail() { echo "sandlot guest init: $*" >&2; exit 1; }
mount -t devtmpfs dev /dev || fail "cannot mount /dev"
mount -t proc proc /proc || fail "cannot mount /proc"
mount -t sysfs sys /sys || fail "cannot mount /sys"
# The virtio drivers the kernel builds as modules, in dependency order (insmod resolves
# none); scripts/setup-vm.sh lists them, leaving out those built in.
for m in $(cat /lib/modules/load-order); do
  insmod /lib/modules/$m.ko || fail "cannot load the $m driver"
done
disk_mb=1024
tmp_mb=256
template=0
for word in $(cat /proc/cmdline); do
  case "$word" in
    sandlot.disk_mb=*) disk_mb=${word#*=} ;;
    sandlot.tmp_mb=*) tmp_mb=${word#*=} ;;
    sandlot.template=1) template=1 ;;
  esac
done
# Drivers probe as they load; the devices' nodes may lag a moment (bounded). The
# channel is the virtio-serial port the host named "sandlot" (its device number depends
# on the order devices are enumerated in).
port=""
n=0
while :; do
  for p in /sys/class/virtio-ports/*; do
    [ "$(cat "$p/name" 2>/dev/null)" = sandlot ] && port=/dev/${p##*/}
  done
  [ -b /dev/vda ] && [ -n "$port" ] && [ -c "$port" ] && break
  n=$((n + 1))
  if [ $n -gt 500 ]; then
    echo "virtio devices: $(ls /sys/bus/virtio/devices 2>&1); /dev: $(ls /dev | tr '\n' ' ')" >&2
    fail "no root disk (/dev/vda) or channel port after 5 s"
  fi
  sleep 0.01
done
# The channel becomes fds 0 and 1 (the runner's --stdio mode), opened now, while /dev is
# still here; fd 2 stays the console. guest_boot.py waits for the host end of the port,
# says so, and execs the runner.
exec 0<>"$port" 1>&0
# The guest's only network interface is its loopback (servers and clients inside the
# sandbox talk over it, as in the other backends); there is no network device.
ip link set lo up || fail "cannot bring up the loopback interface"
mount -t ext4 -o ro,noatime,noload /dev/vda /newroot || fail "cannot mount the root filesystem"
mount -t tmpfs -o "size=${disk_mb}m,mode=0700,uid=1000,gid=1000,nosuid,nodev" home /newroot/home/user \
  || fail "cannot mount /home/user"
mount -t tmpfs -o "size=${tmp_mb}m,mode=1777,nosuid,nodev" tmp /newroot/tmp || fail "cannot mount /tmp"
mount -t tmpfs -o "size=16m,mode=0755,nosuid,nodev" lib /newroot/opt/sandlot/lib \
  || fail "cannot mount the runner's directory"
cp -a /sandlot-lib/. /newroot/opt/sandlot/lib/ || fail "cannot copy the runner"
mount -o remount,ro /newroot/opt/sandlot/lib
mount --move /dev /newroot/dev
mkdir -p /newroot/dev/shm /newroot/dev/pts 2>/dev/null
mount -t tmpfs -o "size=64m,mode=1777,nosuid,nodev" shm /newroot/dev/shm
mount -t devpts -o "nosuid,noexec" devpts /newroot/dev/pts
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
if [ "$template" = 1 ]; then
  # A snapshot template (backends/microvm/_snapshot.py): pid 1 stays root, with no
  # effective capabilities while it imports the data stack, so that each copy restored
  # from the snapshot can reseed the kernel's random generator with the host's entropy
  # before guest_boot.py drops to uid 1000 exactly as setpriv does below. No user code
  # runs before that.
  exec switch_root /newroot /usr/bin/env -i PATH=/opt/sandlot/template/env/bin:/usr/local/bin:/usr/bin:/bin \
    HOME=/home/user LANG=C.UTF-8 \
    /opt/sandlot/template/env/bin/python -I -B /opt/sandlot/lib/guest_boot.py \
    /opt/sandlot/lib "$(cat /sandlot-lib/bootstrap.py)" --template
fi
exec switch_root /newroot /usr/bin/setpriv --reuid=1000 --regid=1000 --clear-groups \
  --inh-caps=-all --bounding-set=-all --no-new-privs \
  /usr/bin/env -i PATH=/opt/sandlot/template/env/bin:/usr/local/bin:/usr/bin:/bin \
  HOME=/home/user LANG=C.UTF-8 \
  /opt/sandlot/template/env/bin/python -I -B /opt/sandlot/lib/guest_boot.py \
  /opt/sandlot/lib "$(cat /sandlot-lib/bootstrap.py)"
