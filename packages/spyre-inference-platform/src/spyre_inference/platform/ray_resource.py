"""The ``spyre`` Ray resource: what one vLLM rank reserves under the Ray executor.

vLLM 0.33's Ray executor (``RayExecutorV2``) places one rank per unit of the
platform's ``ray_device_key`` resource and asks each Ray worker for its share
through ``ray.get_runtime_context().get_accelerator_ids()[ray_device_key]``.
That dictionary only holds the accelerators Ray has a manager for (GPU, TPU,
NPU, ...), and Ray 2.60 has no registry for other vendors' managers: it lists
its own in ``ray._private.accelerators.get_all_accelerator_managers``. Without a
manager every Ray worker dies in that lookup with ``KeyError: 'spyre'``.

:class:`SpyreAcceleratorManager` is Ray's view of the resource: one unit per
card on the spyre target; on the cpu target (and the emulated card) one unit per
logical CPU (a rank per core is the sensible host deployment; a node started with
``ray start --resources '{"spyre": N}'`` may declare any number).
:func:`register_with_ray` adds it to Ray's list: the one runtime patch of the
Ray path, unavoidable while Ray has no public way to add a manager. It runs in
the engine's process before Ray starts there (so a local cluster detects the
resource; ``ray_executor``) and in each Ray worker when vLLM resolves the
platform there (``TorchSpyrePlatform.__init__``).
"""

from __future__ import annotations

import os

from ray._private import accelerators as ray_accelerators
from ray._private.accelerators.accelerator import AcceleratorManager

from spyre_inference.platform import device as dev

#: The Ray resource a vLLM rank reserves (the platform's ``ray_device_key``).
RESOURCE = "spyre"


class SpyreAcceleratorManager(AcceleratorManager):
    """Ray's accelerator manager for the ``spyre`` resource."""

    @staticmethod
    def get_resource_name() -> str:
        return RESOURCE

    @staticmethod
    def get_visible_accelerator_ids_env_var() -> str | None:
        # A worker's card follows its local rank (exported as LOCAL_RANK for
        # torch-spyre, distributed_env.py); no visible-devices variable is narrowed.
        return None

    @staticmethod
    def get_current_process_visible_accelerator_ids() -> list[str] | None:
        return None

    @staticmethod
    def get_current_node_num_accelerators() -> int:
        if dev.has_card():
            return dev.card_count()
        return os.cpu_count() or 1  # the cpu target and the emulated card

    @staticmethod
    def get_current_node_accelerator_type() -> str | None:
        return None

    @staticmethod
    def get_current_node_additional_resources() -> dict[str, float] | None:
        return None

    @staticmethod
    def validate_resource_request_quantity(quantity: float) -> tuple[bool, str | None]:
        if float(quantity).is_integer():
            return True, None
        return False, f"{RESOURCE} must be requested in whole units, not {quantity}"

    @staticmethod
    def set_current_process_visible_accelerator_ids(ids: list[str]) -> None:
        return None


def register_with_ray() -> None:
    """Add :class:`SpyreAcceleratorManager` to Ray's accelerator list (idempotent).

    Ray reads the list through the module attribute on every call, so replacing
    the attribute reaches all of Ray's callers; the cached name-to-manager map
    is dropped so that it is rebuilt with the new entry.
    """
    current = ray_accelerators.get_all_accelerator_managers
    if getattr(current, "spyre_registered", False):
        return

    def get_all_accelerator_managers() -> set[type[AcceleratorManager]]:
        return {*current(), SpyreAcceleratorManager}

    get_all_accelerator_managers.spyre_registered = True  # type: ignore[attr-defined]
    ray_accelerators.get_all_accelerator_managers = get_all_accelerator_managers
    lookup = ray_accelerators.get_accelerator_manager_for_resource
    if hasattr(lookup, "_resource_name_to_accelerator_manager"):
        del lookup._resource_name_to_accelerator_manager
