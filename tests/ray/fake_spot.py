"""Ray's fake multi-node node provider whose nodes can be reclaimed, as spot instances are (tests/ray/autoscale.py).

`FakeMultiNodeProvider` lists a node until the autoscaler terminates it. A cloud stops listing an instance
the moment it reclaims it, and the autoscaler then launches a replacement for the work still waiting. With
the fake provider a killed node stays listed (the v1 autoscaler's liveness check keeps faking heartbeats
for a node the GCS has dropped), so nothing would replace it. Here a node whose raylet has exited is no
longer listed — what a cloud's API shows for a reclaimed instance — and its leftover processes are ended.
Loaded by the autoscaler as provider `type: external`, `module: fake_spot.SpotFakeProvider`.
"""

from __future__ import annotations

import logging

from ray._private import ray_constants
from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider
from ray.autoscaler.tags import TAG_RAY_USER_NODE_TYPE

logger = logging.getLogger("ray.autoscaler.fake_spot")  # into the autoscaler's monitor.log


class SpotFakeProvider(FakeMultiNodeProvider):
    def non_terminated_nodes(self, tag_filters):
        with self.lock:
            gone = [node_id for node_id, v in self._nodes.items() if "node" in v and not _raylet_alive(v["node"])]
            for node_id in gone:
                node = self._nodes.pop(node_id)
                logger.warning(
                    f"SpotFakeProvider: reclaimed node {node_id} of type {node['tags'][TAG_RAY_USER_NODE_TYPE]} (its "
                    "raylet exited)"
                )
                self._terminate_node(node)
            return super().non_terminated_nodes(tag_filters)


def _raylet_alive(node) -> bool:
    raylets = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
    return any(p.process.poll() is None for p in raylets)
