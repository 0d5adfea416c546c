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
imports Ray. See docs/ray.md for what is guaranteed and what is not built yet.
"""

from sandlot.ray._batch import BatchProgress, run_batch
from sandlot.ray._cluster import ClusterFiles, ClusterSandbox, NoCapacity, SandlotCluster
from sandlot.ray._node import NodeInfo, SandlotNode
from sandlot.ray._program import BatchExecution, Program
from sandlot.ray._serve import NodeService, RayDirectory, serve_cluster

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
