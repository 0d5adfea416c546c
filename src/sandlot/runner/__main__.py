"""Entry point inside the sandbox: ``python -m sandlot.runner {supervisor|kernel|zygote|exec}``."""

from __future__ import annotations

import sys


def main(argv: "list[str] | None" = None) -> int:
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
