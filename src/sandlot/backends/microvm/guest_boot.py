"""Runs INSIDE the microVM, as pid 1, just before the runner (stdlib only).

The guest init execs this with the channel port on fds 0 and 1. A virtio-serial port
exists in the guest before the host side is known to be connected; until then the
guest kernel answers reads with end-of-file and drops what the host sends. So: wait
(bounded) until the port stops reporting a hang-up, tell the host with one line, then
exec the runner in this same process (it stays pid 1)."""

import os
import select
import sys
import time

GUEST_UP = b"sandlot-guest-up\n"


def main() -> None:
    lib, bootstrap = sys.argv[1], sys.argv[2]
    poller = select.poll()
    poller.register(0, select.POLLIN | select.POLLOUT)
    deadline = time.monotonic() + 30.0
    while True:
        events = poller.poll(100)
        if events and not events[0][1] & (select.POLLHUP | select.POLLERR):
            break
        if time.monotonic() > deadline:
            sys.stderr.write("sandlot guest: the host never connected the channel port\n")
            sys.exit(70)
        time.sleep(0.005)  # a hung-up port polls ready at once: do not spin
    view = memoryview(GUEST_UP)
    while view:
        view = view[os.write(1, view) :]
    python = sys.executable
    os.execv(python, [python, "-I", "-B", "-c", bootstrap, lib, "supervisor", "--stdio"])


main()
