"""sandlot on a Ray cluster: a sandlot node on every Ray node, and a batch API.

::

    import ray
    from sandlot.ray import Program, SandlotCluster, run_batch

    ray.init(address="auto")
    with SandlotCluster() as cluster:
        executions = run_batch(
            [Program("print(6 * 7)"), Program("1 / 0", timeout=5)],
            cluster=cluster,
            progress=True,
        )
        # in input order; each says where it ran (node_id, node_ip)
        with cluster.create() as sbx:          # one sandbox, held by one node
            sbx.run_code("x = 1")
            sbx.run_code("x + 1").text         # '2'

Needs the ``ray`` extra (``pip install 'sandlot[ray]'``); nothing else in sandlot
imports Ray. The front door (``sandlot serve --ray``: :func:`serve_cluster`,
:class:`RayDirectory`, :class:`NodeService`) also needs the ``server`` extra and is
imported only when one of those names is used. See docs/ray.md for what is guaranteed
and what is not built yet.
"""

from typing import TYPE_CHECKING, Any

from sandlot.ray._batch import BatchProgress, run_batch
from sandlot.ray._cluster import ClusterFiles, ClusterSandbox, NoCapacity, SandlotCluster
from sandlot.ray._node import NodeInfo, SandlotNode
from sandlot.ray._program import BatchExecution, Program

if TYPE_CHECKING:
    from sandlot.ray._serve import NodeService, RayDirectory, serve_cluster

_FRONT_DOOR = frozenset({"NodeService", "RayDirectory", "serve_cluster"})


def __getattr__(name: str) -> Any:
    # The front door needs the server extra; the batch API must not.
    if name in _FRONT_DOOR:
        from sandlot.ray import _serve

        return getattr(_serve, name)
    raise AttributeError(f"module 'sandlot.ray' has no attribute {name!r}")


__all__ = [
    "BatchExecution",
    "BatchProgress",
    "ClusterFiles",
    "ClusterSandbox",
    "NoCapacity",
    "NodeInfo",
    "NodeService",
    "Program",
    "RayDirectory",
    "SandlotCluster",
    "SandlotNode",
    "run_batch",
    "serve_cluster",
]
