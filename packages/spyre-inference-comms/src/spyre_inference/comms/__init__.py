"""spyre-inference-comms: the device communicator for tensor parallelism.

Published to the core through the ``spyre_inference.communicators`` entry-point
group (name ``spyre``); the platform hands vLLM this class's qualified name.
"""

from spyre_inference.comms._version import __version__
from spyre_inference.comms.communicator import (
    REDUCE_SCATTER_UNSUPPORTED,
    SPYRE_PG_BACKEND,
    SpyreCommunicator,
)

__all__ = ["REDUCE_SCATTER_UNSUPPORTED", "SPYRE_PG_BACKEND", "SpyreCommunicator", "__version__"]
