"""Multi-LoRA serving on the cpu target, against transformers on merged weights.

Two PEFT-format adapters (q/v projections and the MLP's down projection, so the
fused QKV and the row-parallel linear both carry one) are built with seeded
random weights. The reference is transformers in float32 on a copy of the base
model with ``W + (alpha / r) * B @ A`` merged into each targeted weight. vLLM's
own LoRA layers wrap the plugin's linears and add the adapters through its CPU
punica wrapper.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest

from spyre_inference.testing import TEST_PROMPTS, hf_greedy
from tests.serving import serve


@pytest.fixture
def llm_in_process() -> bool:
    """``make_llm`` engines in this process: the subject is what the engine computes
    (the engine process as served is the rest of ``tests/``'s subject)."""
    return True


RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "v_proj", "down_proj")
MAX_TOKENS = 12


@pytest.fixture(autouse=True)
def _lora_buckets(monkeypatch) -> None:
    """The test plugin's bucket set holds 1, which LoRA refuses (its ops cannot be
    compiled for a 1-token step): these engines start at 2, as LoRA's default does."""
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "2,8,64")


def _make_adapter(base: Path, out: Path, seed: int) -> dict[str, torch.Tensor]:
    """Write a PEFT LoRA adapter for ``base``; returns its merged deltas by weight name."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    shapes = {  # (out, in) of each target
        "q_proj": (heads * head_dim, hidden),
        "v_proj": (config.num_key_value_heads * head_dim, hidden),
        "down_proj": (hidden, config.intermediate_size),
    }
    gen = torch.Generator().manual_seed(seed)
    tensors, deltas = {}, {}
    for layer in range(config.num_hidden_layers):
        for target in TARGETS:
            module = "mlp" if target == "down_proj" else "self_attn"
            name = f"model.layers.{layer}.{module}.{target}"
            rows, cols = shapes[target]
            a = torch.randn(RANK, cols, generator=gen) * 0.2
            b = torch.randn(rows, RANK, generator=gen) * 0.2
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
            deltas[f"{name}.weight"] = (ALPHA / RANK) * (b @ a)
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors")
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": str(base),
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return deltas


def _merged(base: Path, deltas: dict[str, torch.Tensor], out: Path) -> Path:
    """A float32 copy of ``base`` with the adapter merged in (the reference model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    state = model.state_dict()
    with torch.no_grad():
        for name, delta in deltas.items():
            state[name].add_(delta)
    model.save_pretrained(out)
    for item in base.iterdir():
        if item.name.startswith("tokenizer") or item.name == "special_tokens_map.json":
            shutil.copy(item, out / item.name)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (adapter folder, merged reference model folder)."""
    root = tmp_path_factory.mktemp("lora")
    made = {}
    for i, name in enumerate(("alpha", "beta")):
        deltas = _make_adapter(tiny_llama, root / name, seed=100 + i)
        made[name] = (root / name, _merged(tiny_llama, deltas, root / f"{name}-merged"))
    return made


def test_two_adapters_and_base_in_one_batch_equal_merged_transformers(
    tiny_llama, adapters, make_llm
) -> None:
    prompts = list(TEST_PROMPTS[:3])
    llm = make_llm(tiny_llama, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=RANK)
    requests = [
        LoRARequest("alpha", 1, str(adapters["alpha"][0])),
        LoRARequest("beta", 2, str(adapters["beta"][0])),
        None,
    ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Every prompt under each of the three, all nine in one batch.
    batch = [p for p in prompts for _ in requests]
    loras = [r for _ in prompts for r in requests]
    outputs = llm.generate(batch, params, lora_request=loras)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    want = {
        "alpha": hf_greedy(adapters["alpha"][1], prompts, MAX_TOKENS, "float32"),
        "beta": hf_greedy(adapters["beta"][1], prompts, MAX_TOKENS, "float32"),
        None: hf_greedy(tiny_llama, prompts, MAX_TOKENS, "float32"),
    }
    for i, prompt_index in enumerate(i for i in range(len(prompts)) for _ in requests):
        request = loras[i]
        key = request.lora_name if request is not None else None
        assert got[i] == want[key][prompt_index], (key, prompt_index)
    # The adapters change the answers, so the comparison above can fail.
    assert want["alpha"] != want[None] and want["beta"] != want[None]


def test_serve_lora_modules(tiny_llama, adapters) -> None:
    args = [
        "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "4",
        "--max-num-batched-tokens", "128", "--enable-lora", "--max-lora-rank", str(RANK),
        "--lora-modules", f"alpha={adapters['alpha'][0]}", f"beta={adapters['beta'][0]}",
    ]  # fmt: skip
    prompt = TEST_PROMPTS[0]
    with serve(tiny_llama, args) as server:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="none")
        names = {m.id for m in client.models.list().data}
        assert {"alpha", "beta"} <= names
        got = {
            name: client.completions.create(
                model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
            )
            .choices[0]
            .text
            for name in ("alpha", "beta")
        }
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    for name in ("alpha", "beta"):
        want_ids = hf_greedy(adapters[name][1], [prompt], MAX_TOKENS, "float32", ignore_eos=False)
        assert got[name] == tokenizer.decode(want_ids[0], skip_special_tokens=True), name
