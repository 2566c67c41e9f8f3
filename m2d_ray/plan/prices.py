"""Hourly prices of the node types a run holds: what `m2d plan` turns node-hours into dollars with.

The table is AWS's Linux list price in us-west-2 (on-demand; spot: a typical recent price, which moves),
by instance type, as cluster.yaml's node types name it (`node_config.InstanceType`). A node type is priced
at spot when its `node_config` asks for spot (`InstanceMarketOptions.MarketType: spot`). `plan.prices`
overrides it by node type name or instance type (a region, a discount, another cloud).
"""

from __future__ import annotations

from m2d_ray.plan.devices import NodeType

#: instance type -> (on-demand, spot) $/hour (AWS us-west-2, 2025; check your region and date)
PRICES = {
    "m5.2xlarge": (0.384, 0.15),
    "g5.2xlarge": (1.212, 0.48),
    "g5.12xlarge": (5.672, 2.20),
    "p4d.24xlarge": (21.96, 9.00),
    "p5.48xlarge": (55.04, 30.00),
    "p5en.48xlarge": (63.30, 35.00),
}


def hourly(node: NodeType, overrides: dict[str, float] | None = None) -> float | None:
    """$/hour of one node of this type (None: neither plan.prices nor the table knows it)."""
    overrides = overrides or {}
    for key in (node.name, node.instance):
        if key is not None and key in overrides:
            return overrides[key]
    row = PRICES.get(node.instance or "")
    return None if row is None else row[1 if node.spot else 0]
