"""Entry point inside the sandbox: ``python -m sandlot.runner {supervisor|kernel|zygote|exec}``."""

from __future__ import annotations

import os
import signal
import sys

_RESET = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGCHLD")
"""Signals an inherited "ignore" is taken off (SIGPIPE and SIGXFSZ are Python's own)."""


def clean_start() -> None:
    """Start as a process started from a login shell does, whatever the host process
    that started the sandbox had set: no signal blocked, none of :data:`_RESET`
    ignored, and the usual file mode mask (022). All three are inherited through fork
    and exec from whichever host thread started the sandbox. A host that blocks or
    ignores signals in its threads (a Ray worker blocks SIGINT in its own) would
    otherwise pass that to every process in the sandbox, and a cell's interrupt, which
    is a SIGINT to its kernel, would never arrive (a timeout then cost the kernel and
    its state; a client that left did not stop its cell); a service's umask (077, 000)
    would decide the modes of the files code and the files API create."""
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
    for name in _RESET:
        signum = getattr(signal, name)
        if signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
    os.umask(0o022)


def main(argv: "list[str] | None" = None) -> int:
    clean_start()
    args = list(sys.argv[1:] if argv is None else argv)
    role = args[0] if args else ""
    if role == "supervisor":
        from sandlot.runner._supervisor import main as run
    elif role == "kernel":
        from sandlot.runner._kernel import main as run
    elif role == "zygote":
        from sandlot.runner._zygote import main as run
    elif role == "exec":
        from sandlot.runner._limits import exec_main as run
    else:
        sys.stderr.write(
            "usage: sandlot.runner {supervisor|kernel|zygote|exec} --fd N --config JSON\n"
        )
        return 2
    return run(args[1:])


if __name__ == "__main__":
    sys.exit(main())
