"""The ``topology`` sub-block: topology-aware (hierarchical) gradient reduction."""

from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator, model_validator

from robust_plugins.errors import ConfigError
from robust_plugins.schema._base import Hint, Section
from robust_plugins.schema.checkpoint import path_string
from robust_plugins.schema.common import BLOCK_KEY

#: An environment variable's name, or null.
_EnvName = Annotated[str | None, Field(min_length=1), Hint(expect="an environment variable name or null",
                                                           rule="must be an environment variable name or null")]


class TopologyConfig(Section):
    """Topology-aware gradient reduction (``"topology"`` sub-block; ``robust_plugins.topology``)."""

    where: ClassVar[str] = f"{BLOCK_KEY}.topology"

    hierarchical: bool = False
    """Reduce data-parallel gradients hierarchically: fp32 reduce-scatter inside each node, the
    ``compression`` codec across nodes on rail groups, fp32 all-gather inside the node (a gradient
    reduce-scatter, megatron-core's distributed optimizer and DeepSpeed ZeRO-3, stops before the
    all-gather, each rank with its own shard). Needs the
    ``compression`` sub-block (``"codec": "none"`` for an all-fp32 hierarchy). A data-parallel
    group smaller than the job (tensor/pipeline parallelism) gets a hierarchy planned on its own
    ranks. With ``"codec": "auto"`` this allows the hierarchy: ``auto`` then chooses per bucket
    size between the flat all-reduce and the hierarchy, and the codec."""

    file: Annotated[str | None, Hint(expect="a file path (string) or null")] = None
    """Topology file (JSON, or YAML with PyYAML) keyed by host name; ``None``: discovered
    (``ROBUST_TOPOLOGY_SIM``, NVML, SLURM, Kubernetes labels, host names, in that order)."""

    k8s_node_env: _EnvName = None
    """Environment variable holding the Kubernetes node name (downward API ``spec.nodeName``);
    setting it turns the Kubernetes source on. Untested on a real cluster."""

    k8s_switch_envs: Annotated[tuple[Annotated[str, Field(min_length=1)], ...],
                               Hint(expect="a list", rule="must be a list of environment variable names")] = ()
    """Environment variables holding switch-tier node labels, lowest tier first (e.g. rack, then
    spine); each must be set on every rank when ``k8s_node_env`` is."""

    k8s_domain_env: _EnvName = None
    """Environment variable holding an NVLink-domain label, if the cluster labels one."""

    @field_validator("file", mode="before")
    @classmethod
    def _file(cls, value: Any) -> Any:
        return path_string(value, "a path")

    @field_validator("k8s_switch_envs", mode="before")
    @classmethod
    def _envs(cls, envs: Any) -> tuple:
        # JSON gives a list; a string would iterate as letters.
        if isinstance(envs, str) or not isinstance(envs, (list, tuple)) or not all(
                isinstance(v, str) and v for v in envs):
            raise ValueError("must be a list of environment variable names")
        return tuple(envs)

    @model_validator(mode="after")
    def _kubernetes(self) -> "TopologyConfig":
        if (self.k8s_switch_envs or self.k8s_domain_env) and not self.k8s_node_env:
            raise ConfigError(
                f"{self.where}.k8s_switch_envs / k8s_domain_env need {self.where}.k8s_node_env (the variable "
                f"holding the node name), which turns the Kubernetes source on."
            )
        return self

    def describe(self) -> str:
        """One-line summary for logs and ``robust check-config``."""
        return f"topology(hierarchical={self.hierarchical}, file={self.file})"
