"""Per-block compilation: structural block finding, in-place compile, depth independence.

The models here are small ``nn.Module`` stacks shaped like vLLM's (a block owns
``self_attn.attn``, a vLLM ``Attention``), compiled for real with Inductor.
The Attention instances are real ``vllm...Attention`` objects whose
constructor is not run (it needs an engine config and an attention backend,
which the platform package alone does not have): block finding only asks
``isinstance``, and the blocks' forwards do not call them. Engine-level checks
with vLLM's own models are in the repository's ``tests/test_compile_granularity.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.utils import PPMissingLayer

from spyre_inference.platform import settings
from spyre_inference.platform.block_compile import (
    baked_layer_names,
    check_depth_independence,
    compile_model,
    configure_inductor_cache,
    default_inductor_cache_dir,
    find_block_lists,
)

HIDDEN = 64
TOKENS = 8


def _bare_attention() -> Attention:
    attn = Attention.__new__(Attention)
    nn.Module.__init__(attn)
    return attn


class _SelfAttn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.attn = _bare_attention()


class DecoderBlock(nn.Module):
    """Llama's control flow: layer 0 has no residual yet, so it specializes."""

    def __init__(self, layer_name: str = "") -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.self_attn = _SelfAttn()
        self.mlp = nn.Linear(HIDDEN, HIDDEN)
        self.layer_name = layer_name

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
        else:
            hidden = hidden + residual
            residual = hidden
        hidden = self.mlp(torch.relu(self.self_attn.qkv(self.norm(hidden))))
        return hidden, residual


class NamedBlock(DecoderBlock):
    """A block whose graph depends on its own name, like an attention layer name
    passed to the attention op as a plain string (``VLLM_USE_LAYERNAME=0``)."""

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = super().forward(hidden, residual)
        return hidden * float(int(self.layer_name.rsplit(".", 1)[-1]) + 1), residual


class MambaLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, HIDDEN)
        self.layers = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed(ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        return self.norm(hidden + residual)


class Wrapper(nn.Module):
    """``XForCausalLM``-style: the stack under ``model``."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.model = Stack(blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids)


def _llama(depth: int, cls: type[DecoderBlock] = DecoderBlock) -> Wrapper:
    torch.manual_seed(0)
    return Wrapper([cls(f"model.layers.{i}") for i in range(depth)]).eval()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path_factory):
    """Fresh Dynamo state per test; Inductor's cache in a session temp dir, not ~/.cache."""
    monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "inductor-cache")
    )
    monkeypatch.delenv("SPYRE_COMPILE_GRANULARITY", raising=False)
    settings.reset_cache()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    settings.reset_cache()


# ---- finding blocks ----------------------------------------------------------


def test_decoder_stack_is_found() -> None:
    model = _llama(3)
    assert [name for name, _ in find_block_lists(model)] == ["model.layers"]


def test_encoder_stack_is_found() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.ModuleList([DecoderBlock() for _ in range(2)])

    class Bert(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = Encoder()
            self.pooler_heads = nn.ModuleList([nn.Linear(HIDDEN, 2)])

    bert = nn.Module()
    bert.bert = Bert()
    assert [name for name, _ in find_block_lists(bert)] == ["bert.encoder.layer"]


def test_hybrid_stack_with_mamba_layers_is_found() -> None:
    model = Wrapper([MambaLike(), DecoderBlock(), MambaLike(), MambaLike()])
    found = find_block_lists(model)
    assert [name for name, _ in found] == ["model.layers"]
    assert len(found[0][1]) == 4


def test_list_of_bare_attention_layers_is_skipped() -> None:
    # Zamba2's shared ``dpa_list``: Attention layers themselves, not blocks.
    model = Wrapper([MambaLike(), MambaLike()])
    model.dpa_list = nn.ModuleList([_bare_attention(), _bare_attention()])
    assert find_block_lists(model) == []


def test_pipeline_placeholders_are_ignored() -> None:
    model = Wrapper([PPMissingLayer(), PPMissingLayer(), DecoderBlock(), DecoderBlock()])
    assert [name for name, _ in find_block_lists(model)] == ["model.layers"]
    only_missing = Wrapper([PPMissingLayer(), PPMissingLayer()])
    assert find_block_lists(only_missing) == []


def test_stack_nested_in_a_block_belongs_to_that_block() -> None:
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sub_layers = nn.ModuleList([DecoderBlock(), DecoderBlock()])

    model = nn.Module()
    model.layers = nn.ModuleList([Outer(), Outer()])
    assert [name for name, _ in find_block_lists(model)] == ["layers"]


def test_model_without_vllm_attention_has_no_stack() -> None:
    # MLA, vision towers: attention that is not a vLLM Attention.
    model = nn.Module()
    model.layers = nn.ModuleList([MambaLike(), MambaLike()])
    assert find_block_lists(model) == []


# ---- compiling in place ------------------------------------------------------


def _ids() -> torch.Tensor:
    return torch.arange(TOKENS) % 32


@pytest.mark.parametrize("depth", [2, 6])
def test_block_graphs_do_not_grow_with_depth(depth: int) -> None:
    model = _llama(depth)
    with torch.no_grad():
        eager = model(_ids())
    report = compile_model(model)
    assert report.granularity == "block"
    assert report.stacks == ("model.layers",)
    assert report.classes == {"DecoderBlock": depth}
    with torch.no_grad():
        compiled = model(_ids())
    # Layer 0 (no residual) and the rest: two graphs at any depth.
    assert report.artifacts() == {"DecoderBlock": 2}
    torch.testing.assert_close(compiled, eager)
    assert baked_layer_names(report) == {}
    assert check_depth_independence(report)


def test_parameter_names_and_save_reload_unchanged(tmp_path: Path) -> None:
    model = _llama(3)
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    report = compile_model(model)
    with torch.no_grad():
        out = model(_ids())
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys
    assert not any("_orig_mod" in k for k in keys)
    # The list entries are the same module objects, not OptimizedModule wrappers.
    assert all(type(block) is DecoderBlock for block in model.model.layers)
    assert report.total_artifacts() > 0

    # Save the compiled model's weights, reload them into a fresh uncompiled
    # model with other weights: strict load, same output.
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    torch.manual_seed(123)
    fresh = Wrapper([DecoderBlock() for _ in range(3)]).eval()
    fresh.load_state_dict(load_file(str(path)), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(_ids()), out)
    # ...and back into the compiled one (weights are graph inputs, not constants).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model.load_state_dict(load_file(str(path)), strict=True)
        torch.testing.assert_close(model(_ids()), out)


def test_model_granularity_compiles_one_graph(monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_COMPILE_GRANULARITY", "model")
    settings.reset_cache()
    model = _llama(4)
    with torch.no_grad():
        eager = model(_ids())
    names = [n for n, _ in model.named_parameters()]
    report = compile_model(model)
    assert report.granularity == "model"
    assert report.stacks == ()
    with torch.no_grad():
        compiled = model(_ids())
    assert report.artifacts() == {"Wrapper": 1}
    assert [n for n, _ in model.named_parameters()] == names
    torch.testing.assert_close(compiled, eager)
    assert all(block._compiled_call_impl is None for block in model.model.layers)


def test_model_without_stack_falls_back_to_whole_model() -> None:
    class NoAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(3)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    model = NoAttention().eval()
    report = compile_model(model)
    assert report.granularity == "model"
    with torch.no_grad():
        model(torch.randn(TOKENS, HIDDEN))
    assert report.artifacts() == {"NoAttention": 1}


def test_names_baked_into_graphs_are_detected(caplog) -> None:
    """A block graph that depends on its layer name compiles once per layer: warned."""
    model = _llama(4, NamedBlock)
    report = compile_model(model)
    with torch.no_grad():
        model(_ids())
    # Dynamo guards each graph on one layer_name value: one graph per block.
    assert report.artifacts() == {"NamedBlock": 4}
    assert baked_layer_names(report) == {"NamedBlock": 4}
    with caplog.at_level("WARNING"):
        assert not check_depth_independence(report)
    assert "baked into the block graphs" in caplog.text


def test_recompile_limit_allows_every_bucket() -> None:
    report = compile_model(_llama(2), num_shapes=40)
    assert report.granularity == "block"
    assert torch._dynamo.config.recompile_limit >= 2 * 40


# ---- Inductor's on-disk cache ------------------------------------------------


def test_cache_dir_defaults_to_user_cache(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expected = tmp_path / "spyre-inference" / "inductor"
    assert default_inductor_cache_dir() == expected
    assert configure_inductor_cache() == str(expected)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(expected)
    assert expected.is_dir()
    # torch asks for the directory through this function: it now answers ours.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(expected)


def test_cache_dir_torch_default_counts_as_unset(monkeypatch, tmp_path: Path) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert configure_inductor_cache() == str(tmp_path / "spyre-inference" / "inductor")


def test_cache_dir_set_by_user_wins(monkeypatch, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert configure_inductor_cache() == str(mine)
    assert not (tmp_path / "xdg").exists()


def test_second_compile_of_same_blocks_comes_from_the_cache(monkeypatch, tmp_path) -> None:
    """After a Dynamo reset (what a new process sees), Inductor loads instead of compiling."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "fresh"))
    counters.clear()
    model = _llama(2)
    compile_model(model)
    with torch.no_grad():
        model(_ids())
    first = dict(counters["inductor"])
    assert first.get("fxgraph_cache_miss", 0) == 2
    torch._dynamo.reset()
    counters.clear()
    model = _llama(2)
    compile_model(model)
    with torch.no_grad():
        model(_ids())
    second = dict(counters["inductor"])
    assert second.get("fxgraph_cache_miss", 0) == 0
    assert second.get("fxgraph_cache_hit", 0) == 2


def test_vllm_disable_compile_cache_turns_inductor_caches_off(monkeypatch, caplog) -> None:
    import vllm.envs as vllm_envs

    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    vllm_envs.disable_envs_cache()
    # torch's config modules are restored through their own ``patch``: pytest >= 9.2's
    # ``monkeypatch.setattr`` undoes a module attribute that is not in the module's
    # ``__dict__`` with ``delattr``, which torch's config module turns into "hide this
    # option", and every later compile then fails reading it.
    with torch.compiler.config.patch(force_disable_caches=False):
        with caplog.at_level("WARNING"):
            configure_inductor_cache()
        assert torch.compiler.config.force_disable_caches
    assert not torch.compiler.config.force_disable_caches
    assert "cache is disabled" in caplog.text
