"""Topology: where each rank runs, the groups that follow from it, and collectives that use them.

Layers, each depending only on the ones above it: ``records`` (data) -> ``discover`` (sources)
-> ``planner`` (pure rank lists) -> ``builder`` (process groups) -> ``hierarchical`` (the
all-reduce and the reduce-scatter) ; ``megatron`` maps megatron-core's rank order onto the topology.
"""

from __future__ import annotations

from robust_plugins.topology.builder import TopologyGroups, build_dp_groups, build_groups, clear_cache
from robust_plugins.topology.discover import (
    SIM_ENV,
    Topology,
    discover,
    load_topology_file,
    parse_sim,
    parse_slurm_topology_addr,
    records_from_gathered,
    records_from_host_table,
)
from robust_plugins.topology.hierarchical import hierarchical_all_reduce, hierarchical_reduce_scatter
from robust_plugins.topology.megatron import inverse, megatron_rank_order
from robust_plugins.topology.planner import (
    TopologyPlan,
    check_dp_groups,
    check_records,
    plan_groups,
    plan_within,
    reduce_scatter_order,
)
from robust_plugins.topology.records import RankRecord, TopologyError, UnevenTopologyError

__all__ = [
    "SIM_ENV",
    "RankRecord",
    "Topology",
    "TopologyError",
    "TopologyGroups",
    "TopologyPlan",
    "UnevenTopologyError",
    "build_dp_groups",
    "build_groups",
    "check_dp_groups",
    "check_records",
    "clear_cache",
    "discover",
    "hierarchical_all_reduce",
    "hierarchical_reduce_scatter",
    "inverse",
    "load_topology_file",
    "megatron_rank_order",
    "parse_sim",
    "parse_slurm_topology_addr",
    "plan_groups",
    "plan_within",
    "records_from_gathered",
    "records_from_host_table",
    "reduce_scatter_order",
]
