"""Host/device buffer pairs with Spyre's dtype rules.

vLLM's ``CpuGpuBuffer`` keeps a host tensor (numpy-backed, for the scheduler)
and a device twin. On Spyre only float tensors may live on the card, so
int/bool buffers alias their device half to the host half (no copy ever
happens); float buffers get a device twin in float16, the card's one dtype
(spec, "Host/device buffers": ``.gpu`` on Spyre as float16), and the copies
convert both ways. On the cpu target every pair collapses to one host tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.utils import CpuGpuBuffer

from spyre_inference.platform import device as dev


class SpyreCpuGpuBuffer(CpuGpuBuffer):
    def __init__(self, *size: int | torch.SymInt, dtype: torch.dtype, with_numpy: bool = True):
        # Build only the host half through the parent (device=cpu, no pinning).
        super().__init__(
            *size, dtype=dtype, device=torch.device("cpu"), pin_memory=False, with_numpy=with_numpy
        )
        if dev.is_spyre() and dtype.is_floating_point:
            with torch.inference_mode(False):
                self.gpu = torch.zeros_like(
                    self.cpu, dtype=dev.default_dtype(), device=dev.device()
                )
        else:
            self.gpu = self.cpu

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        if self.gpu is self.cpu:
            if self.cpu.dtype.is_floating_point:
                dev.note_transfer("h2d")  # a device twin on the card (cost proxy)
            return self.cpu if n is None else self.cpu[:n]
        dev.transfers.h2d += 1
        return super().copy_to_gpu(n)

    def copy_to_cpu(self, n: int | None = None) -> torch.Tensor:
        if self.gpu is self.cpu:
            if self.cpu.dtype.is_floating_point:
                dev.note_transfer("d2h")
            return self.cpu if n is None else self.cpu[:n]
        dev.transfers.d2h += 1
        return super().copy_to_cpu(n)


def alias_host_buffers(runner: Any) -> None:
    """Point the device half of vLLM-built buffers at their host half.

    The input batch (sampling parameters, token ids) and block tables are
    built by vLLM with plain ``CpuGpuBuffer``s and ``*_cpu_tensor`` twins;
    they are host data on both targets because sampling and index
    bookkeeping run on the host.
    """

    def alias(obj: Any) -> None:
        for value in vars(obj).values():
            if isinstance(value, CpuGpuBuffer) and not isinstance(value, SpyreCpuGpuBuffer):
                value.gpu = value.cpu

    alias(runner)
    batch = runner.input_batch
    alias(batch)
    for name, value in list(vars(batch).items()):
        if name.endswith("_cpu_tensor") and isinstance(value, torch.Tensor):
            twin = name[: -len("_cpu_tensor")]
            if isinstance(getattr(batch, twin, None), torch.Tensor):
                setattr(batch, twin, value)
    for table in batch.block_table.block_tables:
        alias(table)
