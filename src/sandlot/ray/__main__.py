"""``python -m sandlot.ray``: drain a node of a ``sandlot serve --ray`` cluster, or list
them, in the shared database every front door reads.

::

    python -m sandlot.ray nodes   --database URL
    python -m sandlot.ray drain   NODE_ID --database URL [--reason TEXT]
    python -m sandlot.ray undrain NODE_ID --database URL

A drained node takes no new sandbox through any front door from the next create on;
what it holds runs on (calls, cells, files) until killed, reaped at its timeout, or
lost. ``nodes`` says how many each still holds: at 0 the node can be stopped without
losing anything. It talks to the database only (no Ray connection).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandlot.ray", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("nodes", "the nodes with live sandboxes or draining, as JSON lines"),
        ("drain", "place no new sandbox on a node"),
        ("undrain", "let a drained node take new sandboxes again"),
    ):
        command = commands.add_parser(name, help=text)
        if name != "nodes":
            command.add_argument("node_id", help="the Ray node ID (hex), as GET /v1/cluster says")
        if name == "drain":
            command.add_argument("--reason", default="drained by an operator")
        command.add_argument(
            "--database", required=True, help="the cluster's shared database URL (PostgreSQL)"
        )
    args = parser.parse_args(argv)

    from sandlot.server import ClusterStore

    store = ClusterStore(args.database)
    try:
        if args.command == "drain":
            changed = store.drain(args.node_id, args.reason)
            print(f"{args.node_id}: {'draining' if changed else 'was draining already'}")
        elif args.command == "undrain":
            changed = store.undrain(args.node_id)
            print(f"{args.node_id}: {'takes new sandboxes' if changed else 'was not draining'}")
        else:
            live, draining = store.live_per_node(), store.draining()
            for node_id in sorted(set(live) | set(draining)):
                row = {
                    "node_id": node_id,
                    "sandboxes": live.get(node_id, 0),
                    "draining": draining.get(node_id),
                }
                print(json.dumps(row))
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
