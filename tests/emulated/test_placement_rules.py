"""The emulated card's placement rules, one test per rule (no engine).

Each rule is one the card imposes and the cpu target cannot see: host and
device are different memories, the card has no bool / small-integer tensors,
device memory is finite, and every transfer is counted where it happens.
"""

from __future__ import annotations

import pytest
import torch

from spyre_inference.platform import device as dev
from spyre_inference.platform import emulated_card


def test_mixing_host_and_device_tensors_raises() -> None:
    d = dev.to_device(torch.ones(4, 64, dtype=torch.float16))
    h = torch.ones(4, 64, dtype=torch.float16)
    assert d.device.type == "spyre"
    with pytest.raises(RuntimeError, match="spyre"):
        d + h
    with pytest.raises(RuntimeError, match="spyre"):
        torch.matmul(h, d.T)
    # Gathers too: an index on the wrong side is a placement bug.
    with pytest.raises(RuntimeError, match="mixes device"):
        d.index_select(0, torch.tensor([1, 2]))


def test_lm_head_with_host_hidden_states_raises() -> None:
    """Issue 22, bug 2: the LM head's weight is on the device; host hidden states must move."""
    from spyre_inference.ops.transposed_weight import spyre_linear_t

    weight_t = dev.to_device(torch.randn(64, 128, dtype=torch.float16))
    hidden = torch.randn(3, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="spyre"):
        spyre_linear_t(hidden, weight_t, None, None)
    logits = spyre_linear_t(dev.to_device(hidden), weight_t, None, None)
    assert logits.device.type == "spyre"
    torch.testing.assert_close(dev.to_host(logits).float(), hidden.float() @ weight_t.cpu().float(),
                               rtol=2e-3, atol=2e-3)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.uint8, torch.int16])
def test_bool_and_small_int_tensors_cannot_be_placed(dtype: torch.dtype) -> None:
    with pytest.raises(RuntimeError, match=r"no \w+ support"):
        torch.zeros(4, dtype=dtype, device="spyre")
    with pytest.raises(RuntimeError, match=r"no \w+ support"):
        torch.zeros(4, dtype=dtype).to("spyre")


def test_device_cannot_produce_a_bool_mask() -> None:
    """Spec (encoder backend): the mask is built on the host, the card cannot produce it."""
    d = dev.to_device(torch.randn(8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="Bool"):
        d.gt(0)


def test_index_tensors_of_the_spec_are_allowed() -> None:
    """int64 gather indices (embedding, RoPE) and the int32 page index live on the card."""
    table = dev.to_device(torch.randn(10, 64, dtype=torch.float16))
    for dtype in (torch.int64, torch.int32):
        idx = dev.to_device(torch.tensor([3, 1], dtype=dtype))
        assert torch.equal(dev.to_host(table[idx]), table.cpu()[torch.tensor([3, 1])])


def test_every_copy_is_counted_by_the_device() -> None:
    h2d, d2h = emulated_card.transfer_counts()
    d = torch.ones(8, dtype=torch.float16).to("spyre")
    d.cpu()
    d.cpu()
    assert emulated_card.transfer_counts() == (h2d + 1, d2h + 2)


def test_a_compiled_graph_call_dispatches_no_ops_of_the_emulator() -> None:
    """The emulator hands a compiled graph host views of its device inputs; building
    them must not dispatch ops. The Spyre cost proxies (``benchmarks/sxs/proxies.py``)
    count eager device ops from the profiler, and once counted two (``empty`` and
    ``set_``) per input of every graph call: 1018 of the 1436 they reported per step."""

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * 2 + y

    compiled = torch.compile(f, backend=dev.compile_backend(), fullgraph=True, dynamic=False)
    x = dev.to_device(torch.randn(4, 64, dtype=torch.float16))
    compiled(x, x)  # compile outside the profiled call
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = compiled(x, x)

    def is_op(name: str) -> bool:
        return "::" in name and not name.startswith("##")

    def outermost(event) -> bool:
        # Not inside another op: what a CPU kernel allocates inside its op is the
        # op's own, as on any device. Ranges (the compiled region's) do not count.
        parent = event.cpu_parent
        while parent is not None:
            if is_op(parent.name):
                return False
            parent = parent.cpu_parent
        return True

    dispatched = [e.name for e in prof.events() if is_op(e.name) and outermost(e)]
    # The graph's own kernels are Inductor's C++ (no aten ops): nothing is left.
    assert dispatched == [], dispatched
    torch.testing.assert_close(dev.to_host(out), x.cpu() * 3)


def test_float_buffers_have_float16_device_twins() -> None:
    """Spec, host/device buffers: ``.gpu`` on Spyre as float16 whatever the host dtype;
    int buffers stay on the host (no integer compute on the card)."""
    from spyre_inference.platform.buffers import SpyreCpuGpuBuffer

    floats = SpyreCpuGpuBuffer(6, dtype=torch.float32)
    assert floats.gpu.device.type == "spyre" and floats.gpu.dtype == torch.float16
    floats.cpu.copy_(torch.tensor([0.5, -1.25, 3.0, 1e-3, 7.0, 2.0]))
    on_card = floats.copy_to_gpu(4)
    assert on_card.dtype == torch.float16
    assert torch.equal(on_card.cpu(), floats.cpu[:4].half())
    floats.cpu.zero_()
    assert torch.equal(floats.copy_to_cpu(4), torch.tensor([0.5, -1.25, 3.0, 1e-3]).half().float())
    ints = SpyreCpuGpuBuffer(6, dtype=torch.int64)
    assert ints.gpu is ints.cpu


def test_device_memory_is_finite() -> None:
    stats = emulated_card.memory_stats()
    free, total = dev.device_memory_info()
    assert total == stats.capacity > 0 and free <= total
    too_big = (stats.capacity - stats.in_use) // 2 + 1024
    with pytest.raises(torch.OutOfMemoryError, match="out of device memory"):
        torch.empty(too_big, dtype=torch.float16, device="spyre")


def test_compiled_graph_mixing_devices_fails_when_traced() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x * 2 + y

    compiled = torch.compile(f, backend=dev.compile_backend(), fullgraph=True, dynamic=False)
    x = dev.to_device(torch.randn(4, 64, dtype=torch.float16))
    out = compiled(x, x)
    assert out.device.type == "spyre"
    torch.testing.assert_close(dev.to_host(out), x.cpu() * 3)
    with pytest.raises(Exception, match="spyre"):
        compiled(x, torch.randn(4, 64, dtype=torch.float16))


def test_compiled_graph_keeps_static_shapes_through_reshapes() -> None:
    """A compiled graph's shapes stay static on the emulated card (dynamic=False).

    Regression: the backend handed Inductor host views that Dynamo had no shape
    record for, so they were re-traced with sourceless symbolic sizes and the
    first reshape guard failed at guard building (CI: the page-attention graph).
    """
    from spyre_inference.platform.block_compile import compile_kwargs

    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        flat_k = k.view(k.shape[0] * k.shape[1], k.shape[2])
        return (q.reshape(-1, 64) @ flat_k.t()).reshape(q.shape[0], -1).softmax(-1)

    # These sizes are the ones that failed: duck sizing gave 64 one symbol, so
    # the reshape's guard reduced to a single sourceless symbol.
    q = torch.randn(8, 4, 64, dtype=torch.float16) / 8
    k = torch.randn(512, 64, 64, dtype=torch.float16)
    torch._dynamo.reset()
    compiled = torch.compile(scores, **compile_kwargs())
    out = compiled(dev.to_device(q), dev.to_device(k))
    assert out.device.type == "spyre"
    torch.testing.assert_close(dev.to_host(out).float(), scores(q.float(), k.float()),
                               rtol=2e-3, atol=2e-3)  # fmt: skip


def test_moe_routing_on_the_device_needs_a_recipe_on_the_card_path() -> None:
    """A MoE layer that routes with the model's own function (vLLM's Transformers MoE
    backend with the HF gate: top-k on the device) is refused on the card path; the cpu
    target calls the function (``test_transformers_backend.py``, HunYuan MoE)."""
    from types import SimpleNamespace

    from spyre_inference.models.moe import default_recipe

    layer = SimpleNamespace(layer_name="model.layers.0.mlp.experts", custom_routing_function=len)
    with pytest.raises(NotImplementedError, match=r"top-k on the device.*MoeRecipe"):
        default_recipe(layer)


def test_model_buffers_the_card_cannot_hold_stay_on_the_host() -> None:
    """A bool buffer (GPT-BigCode's legacy causal mask, never read) stays on the host
    when the model moves; floats and int64 indices move."""
    from spyre_inference.platform.model_runner import move_model_to_device

    model = torch.nn.Linear(64, 64, dtype=torch.float16)
    model.register_buffer("mask", torch.ones(8, 8, dtype=torch.bool), persistent=False)
    model.register_buffer("index", torch.arange(8), persistent=False)
    move_model_to_device(model)
    assert model.weight.device.type == "spyre" and model.index.device.type == "spyre"
    assert model.mask.device.type == "cpu"
    assert not dev.placeable_on_device(torch.int8) and dev.placeable_on_device(torch.int32)
