"""Runs INSIDE a template image while it is built (``RUN python3 /sandlot-build/...``).

Stdlib-only: it runs with the base image's ``python3``, before any package exists.
It lays the image out the way the runner expects a template (the same guest paths
as the bubblewrap backend's mounted template):

* ``/opt/sandlot/template/env``: a venv on top of the image's Python that sees its
  system site-packages, so packages the base already has (Debian's python3-pandas,
  ...) are used as they are and only missing ones are installed with pip;
* ``/opt/sandlot/template/share/matplotlib``: the matplotlibrc and a warm font cache;
* a ``user`` account with uid/gid 1000 and home ``/home/user``;
* the sandbox's view of the file system cut down to what the bubblewrap sandbox sees
  (:func:`_trim`): only the ``/etc`` files it binds, no ``/root``, ``/var``, ``/run``,
  ``/mnt``, ``/media``, ``/srv`` or ``/boot``, and no setuid or setgid bit anywhere.
  A container's root is one overlay that the engine cannot mount ``nosuid``; with no
  such bit left in it (and ``no-new-privileges``), ``su`` or ``mount`` grant nothing.

Configuration comes as JSON in ``argv[1]``: ``packages`` (pip requirements),
``cjk_fonts`` (candidate font names, in order) and ``matplotlibrc`` (the rc text,
whose ``font.family: sans-serif`` line gets the CJK fonts found appended).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import venv

ROOT = "/opt/sandlot/template"
ENV = ROOT + "/env"
SHARE = ROOT + "/share/matplotlib"

ETC_KEPT = frozenset(
    {
        "alternatives", "ca-certificates.conf", "fonts", "group", "hostname", "hosts",
        "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "mime.types",
        "nsswitch.conf", "os-release", "passwd", "ssl",
        # Mount points the engine binds its own files over (resolv.conf and hosts are
        # sandlot's neutral ones, see _compile.py), or creates (Docker's mtab link).
        "resolv.conf", "mtab",
        # Debian's matplotlib reads its defaults from here (the image's own file).
        "matplotlibrc",
    }
)  # fmt: skip
"""What stays in ``/etc``: the files the bubblewrap sandbox sees of the host's ``/etc``
(system accounts, the shadow files, cron, apt, PAM, ... tell code nothing it needs)."""
REMOVED = ("/root", "/var", "/run", "/mnt", "/media", "/srv", "/boot")
"""Directories the bubblewrap sandbox does not have: the image's own are removed."""
NSSWITCH = "passwd: files\ngroup: files\nshadow: files\nhosts: files\nnetworks: files\n"
"""Names resolve from ``/etc/hosts`` only, as under bubblewrap: no DNS lookup is tried."""


def _missing(packages: list[str]) -> list[str]:
    from importlib import metadata

    missing = []
    for requirement in packages:
        name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(requirement)
    return missing


def _ensure_user() -> None:
    # Only the accounts a sandbox needs, as bwrap's generated passwd: the base image's
    # system accounts tell code nothing useful and nothing runs as them.
    with open("/etc/passwd", "w") as handle:
        handle.write(
            "root:x:0:0:root:/root:/bin/sh\n"
            "user:x:1000:1000:sandlot:/home/user:/bin/sh\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
    with open("/etc/group", "w") as handle:
        handle.write("root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n")


def _strip_setid(top: str) -> list[str]:
    """Clear every setuid and setgid bit on ``top``'s file system; the paths changed."""
    changed = []
    device = os.lstat(top).st_dev
    for root, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if os.lstat(os.path.join(root, d)).st_dev == device]
        for name in dirs + files:
            path = os.path.join(root, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode) or not mode & (stat.S_ISUID | stat.S_ISGID):
                continue
            os.chmod(path, stat.S_IMODE(mode) & ~(stat.S_ISUID | stat.S_ISGID))
            changed.append(path)
    return changed


def _trim() -> None:
    """Cut the image down to the bubblewrap sandbox's view (see the module docstring)."""
    for name in os.listdir("/etc"):
        if name in ETC_KEPT:
            continue
        path = os.path.join("/etc", name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    with open("/etc/nsswitch.conf", "w") as handle:
        handle.write(NSSWITCH)
    # Links from /usr into what was just removed (Debian's sitecustomize.py points into
    # /etc/python3.x) would make every interpreter start print an error.
    for root, _dirs, files in os.walk("/usr"):
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path) and not os.path.exists(path):
                target = os.path.realpath(path)
                if target.startswith("/etc/"):
                    os.unlink(path)
    for path in REMOVED:
        if os.path.islink(path):
            os.unlink(path)
        elif os.path.isdir(path):
            # The builder may have a mount below (e.g. /run/secrets): keep what is busy,
            # the engine's mounts cover it at run time.
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(path)
    for name in os.listdir("/home"):
        if name != "user":
            shutil.rmtree(os.path.join("/home", name))
    changed = _strip_setid("/")
    print("sandlot: cleared setuid/setgid bits: " + " ".join(sorted(changed)), flush=True)


def main() -> int:
    config = json.loads(sys.argv[1])
    missing = _missing(list(config["packages"]))
    venv.EnvBuilder(system_site_packages=True, with_pip=bool(missing), symlinks=True).create(ENV)
    python = ENV + "/bin/python"
    if missing:
        print("sandlot: installing from the package index: " + " ".join(missing), flush=True)
        subprocess.run(
            [
                python,
                "-m",
                "pip",
                "install",
                "--no-cache-dir",
                "--disable-pip-version-check",
                *missing,
            ],
            check=True,
        )
    # Read-only at run time: compile bytecode now, or every import compiles from source.
    subprocess.run([python, "-m", "compileall", "-q", "-j", "0", ENV], check=False)
    os.makedirs(SHARE + "/cache", exist_ok=True)
    found = subprocess.run(
        [
            python,
            "-c",
            "import json, sys\n"
            "from matplotlib.font_manager import fontManager\n"
            "present = {f.name for f in fontManager.ttflist}\n"
            "print(json.dumps([n for n in json.loads(sys.argv[1]) if n in present]))",
            json.dumps(config["cjk_fonts"]),
        ],
        env={"MPLCONFIGDIR": SHARE + "/cache", "PATH": "/usr/bin:/bin", "HOME": "/root"},
        check=True,
        capture_output=True,
        text=True,
    )
    fonts = json.loads(found.stdout.strip().splitlines()[-1])
    rc = str(config["matplotlibrc"]).replace(
        "font.family: sans-serif\n", "font.family: " + ", ".join(["sans-serif", *fonts]) + "\n"
    )
    with open(SHARE + "/matplotlibrc", "w") as handle:
        handle.write(rc)
    _ensure_user()
    os.makedirs("/home/user", exist_ok=True)
    os.chown("/home/user", 1000, 1000)
    with open(ROOT + "/template.json", "w") as handle:
        json.dump({"packages": config["packages"], "cjk_fonts": fonts}, handle)
    _trim()
    return 0


if __name__ == "__main__":
    sys.exit(main())
