"""The in-sandbox runner: a supervisor and one kernel per code context.

This package runs INSIDE the sandbox with the template's interpreter. It is
stdlib-only and imports nothing from sandlot but :mod:`sandlot.protocol`; the
backend mounts both packages read-only at ``/opt/sandlot/lib`` and starts::

    python -I -c "<bootstrap>" supervisor --fd 3 --config '<json>'

Process layout inside the sandbox (pid namespace of its own)::

    bwrap (pid 1, reaper)
    └── supervisor  -- fd 3: protocol socket to the host; files.*, commands.run,
        │              timeouts, output caps, process-tree kills, kernel restarts
        ├── kernel "default"   -- one per code context: persistent namespace,
        │   └── (user code's   display hooks; stdout/stderr are pipes the
        │        children)      supervisor reads, so nothing printed is protocol
        └── sh -c <command>    -- commands.run

Trust: everything here shares the sandbox with untrusted code. User code in a
kernel can write to that kernel's event socket, so it can forge *its own* results;
it cannot reach the host's channel, and the host re-checks sizes, shapes and
limits of everything it receives.
"""

BOOTSTRAP = (
    "import sys; sys.path.insert(0, sys.argv[1]); del sys.argv[1]; "
    "from sandlot.runner.__main__ import main; sys.exit(main(sys.argv[1:]))"
)
"""``python -I -c BOOTSTRAP <lib dir> {supervisor|kernel} ...`` starts a runner role.

``-I`` keeps the guest interpreter away from the environment and the working
directory; the runner's own location is put on ``sys.path`` explicitly."""
