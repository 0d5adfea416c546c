"""The guest layout: where things are inside every sandbox, whatever the backend.

Host and runner both import this module (it is stdlib-only, like the rest of
:mod:`sandlot.protocol`), so a path is written down once: the backends mount and
configure by it, the runner finds its files by it, and the SDK checks paths against
:data:`WORKSPACE_ROOTS`. A backend that lays a sandbox out differently is not a
sandlot backend: user code, templates and the files API all assume this layout.
"""

HOME = "/home/user"
"""The working directory and ``$HOME``: a size-capped tmpfs owned by the sandbox user."""
WORKSPACE_ROOTS = (HOME, "/tmp")
"""The directories the files.* API may reach (the working directory and /tmp)."""

SANDBOX_UID = 1000
"""The uid user code runs as inside a bwrap sandbox's user namespace (``user`` in its
/etc/passwd). A Docker/Podman container has no user namespace: it runs as a host uid of
its own, which its own /etc/passwd names ``user`` (``backends/docker/_accounts.py``)."""
SANDBOX_GID = 1000

TEMPLATE_GUEST = "/opt/sandlot/template"
"""Where the template (a relocatable venv plus shared data) is mounted, read-only."""
GUEST_PYTHON = TEMPLATE_GUEST + "/env/bin/python"
"""The template's interpreter as the sandbox sees it."""
GUEST_PATH = TEMPLATE_GUEST + "/env/bin:/usr/local/bin:/usr/bin:/bin"
"""``$PATH`` inside the sandbox: the template's venv first."""
TEMPLATE_SHARE = TEMPLATE_GUEST + "/share"
"""Data the template build prepared (matplotlib's rc and font cache)."""

LIB_GUEST = "/opt/sandlot/lib"
"""Where ``sandlot.protocol`` and ``sandlot.runner`` are mounted (read-only); the
runner's bootstrap puts this directory on ``sys.path``."""

EGRESS_SOCKET_GUEST = "/opt/sandlot/egress.sock"
"""Where a sandbox with a network policy finds its own socket to the host's proxy."""
EGRESS_PORT = 3128
"""The sandbox-side proxy port (the supervisor's forwarder, on the sandbox's own
loopback)."""
