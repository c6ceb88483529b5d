"""Rank environment for torch-spyre's collective library.

libspyre_comms reads the process's rank and world size from the environment
when it is loaded, which happens before vLLM creates its process groups; the
worker exports them first.
"""

from __future__ import annotations

import os


def export_rank_env(rank: int, local_rank: int, world_size: int) -> None:
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(local_rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_WORLD_SIZE"] = os.environ.get("LOCAL_WORLD_SIZE", str(world_size))
