"""``SpyreRayExecutor``: vLLM's Ray executor with the ``spyre`` resource known to Ray.

The platform swaps it in for ``--distributed-executor-backend ray``. It is
vLLM's ``RayExecutorV2`` unchanged except that, before Ray starts in the
engine's process, it registers the ``spyre`` accelerator manager
(``ray_resource``; a local cluster then detects the resource) and refuses a
cluster with fewer units than ranks, with the numbers and the fix, instead of
vLLM's 30-minute wait for a placement group that can never be placed (the
platform makes the same check in the user's process before the engine starts),
and hands every ``SPYRE_*`` variable to the Ray workers in their runtime env.
"""

from __future__ import annotations

import os
from typing import Any

import ray
from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

from spyre_inference.platform import settings
from spyre_inference.platform.ray_resource import (
    RESOURCE,
    SpyreAcceleratorManager,
    register_with_ray,
)
from spyre_inference.platform.startup_checks import ConfigError


class ClusterTooSmallError(ConfigError):
    """The Ray cluster has fewer ``spyre`` units than the engine has ranks."""


def check_cluster_fits(world_size: int) -> None:
    """Refuse, with the numbers, a Ray cluster with fewer ``spyre`` units than ranks.

    Called in the user's process before the engine starts, and again by the
    executor once it is connected (the cluster may have changed in between).
    Without it vLLM waits 30 minutes for a placement group that cannot be placed.
    """
    have, where = _cluster_units()
    if have < world_size:
        raise ClusterTooSmallError(
            f"{where} offers {have} '{RESOURCE}' unit(s) but "
            f"tensor_parallel_size x pipeline_parallel_size = {world_size} ranks need "
            f"{world_size} (one per rank). Add nodes, or declare the units when "
            f"starting each node: ray start ... --resources "
            f"'{{\"{RESOURCE}\": <ranks on this node>}}'."
        )


def _cluster_units() -> tuple[int, str]:
    """``spyre`` units of the cluster vLLM's Ray executor will use, and which it is.

    vLLM calls ``ray.init()`` with no address: ``RAY_ADDRESS``, else a cluster
    ``ray start`` left on this host, else a new local one. Probed the same way
    (``address="auto"`` is the first two); the probe's connection is closed
    again so that the engine makes its own.
    """
    if ray.is_initialized():
        return int(ray.cluster_resources().get(RESOURCE, 0)), "The connected Ray cluster"
    try:
        ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
    except ConnectionError:
        register_with_ray()
        units = SpyreAcceleratorManager.get_current_node_num_accelerators()
        return units, "A new local Ray cluster on this host"
    try:
        return int(ray.cluster_resources().get(RESOURCE, 0)), "The running Ray cluster"
    finally:
        ray.shutdown()


class SpyreRayExecutor(RayExecutorV2):
    """vLLM's Ray executor with the ``spyre`` resource known to Ray everywhere."""

    def _init_executor(self) -> None:
        register_with_ray()
        parallel = self.parallel_config
        if parallel.placement_group is None:
            if not ray.is_initialized():
                # The call vLLM's initialize_ray_cluster makes (it then finds
                # Ray initialised), made first so the cluster can be checked.
                ray.init(runtime_env=parallel.ray_runtime_env)
            if ray.util.get_current_placement_group() is None:
                check_cluster_fits(parallel.world_size)
        super()._init_executor()

    def _build_runtime_env(self) -> dict[str, Any]:
        """Ray's runtime env for the workers, with this process's ``SPYRE_*`` variables.

        vLLM hands a worker the driver's environment only in
        ``initialize_worker``, after the worker has already resolved the
        platform (its first call asks for ``ray_device_key``), and the device
        target and settings are decided on that first resolution. Passed in
        the runtime env they are set when the worker process starts, over a
        node's own values: every rank must run with the same settings (the
        token buckets, for one, must match across tensor-parallel ranks).
        """
        runtime_env = super()._build_runtime_env()
        env_vars = runtime_env.setdefault("env_vars", {})
        for name, value in os.environ.items():
            if name.startswith(settings.PREFIX):
                env_vars.setdefault(name, value)
        return runtime_env
