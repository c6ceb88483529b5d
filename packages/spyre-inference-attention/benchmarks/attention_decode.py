"""Attention time per decode step: batch 1/8/32, context 128/1024, both layouts.

Not a test: a measurement. For every (layout, batched decode on/off, kernel
mode, batch size, context length) it builds one decode step the way vLLM's
runner does (a cache allocated in the backend's layout through vLLM's own
view code, ``CommonAttentionMetadata`` through the backend's builder) and
times, over ``--iters`` steps after warm-up:

* ``build``: the metadata builder, once per step (shared by every layer);
* ``layer``: one layer's ``forward`` (KV store plus attention), the part that
  repeats per layer.

``per step`` is ``build + layers * layer`` for a ``--layers``-deep model
(default 30, SmolLM2-135M's depth). Kernel modes: ``compiled`` (an Inductor
graph per bucket, as served; the variants are compiled before timing) and
``eager`` (the same functions without compilation, as under
``--enforce-eager``). The head-major layout has no batched-decode kernel and
always compiles its attention, so it runs with batched decode off and in
compiled mode only.

Defaults follow SmolLM2-135M's attention (9 query / 3 KV heads, head size 64),
bfloat16 (the cpu target's default), block size 128 (the platform's). Run::

    scripts/test.sh -s perf -- attention_decode.py [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import torch


@dataclasses.dataclass
class Row:
    layout: str
    batched_decode: bool
    mode: str
    batch: int
    context: int
    build_us: float
    layer_us: float
    step_ms: float
    per_seq_layer_us: float


def make_config(args: argparse.Namespace, enforce_eager: bool):
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    model_dir = tempfile.mkdtemp(prefix="attn-bench-")
    LlamaConfig(
        hidden_size=args.heads * args.head_size,
        intermediate_size=256,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_size,
        num_hidden_layers=1,
        vocab_size=256,
        max_position_embeddings=args.max_model_len,
    ).save_pretrained(model_dir)
    model_config = ModelConfig(
        model=model_dir,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        skip_tokenizer_init=True,
        enforce_eager=enforce_eager,
    )
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max(args.batch),
        max_model_len=args.max_model_len,
        is_encoder_decoder=False,
    )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=CacheConfig(block_size=args.block_size),
    )


def allocate(backend, spec, num_blocks: int) -> torch.Tensor:
    from vllm.v1.kv_cache_interface import (
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )

    (layout,) = backend.supported_kv_cache_layouts()
    raw = torch.zeros(num_blocks * spec.page_size_bytes, dtype=torch.int8)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, 1, layout)
    tensor = KVCacheTensor(
        size=raw.numel(), layers=["layer.0"], layer_stride=layer_stride, block_stride=block_stride
    )
    (view,) = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    view.normal_()
    return view


def measure(args, backend, vllm_config, batch: int, context: int) -> tuple[float, float]:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    dtype = vllm_config.model_config.dtype
    bs = args.block_size
    blocks_per_seq = -(-(context + 1) // bs)
    num_blocks = 1 + batch * blocks_per_seq
    spec = FullAttentionSpec(
        block_size=bs, num_kv_heads=args.kv_heads, head_size=args.head_size, dtype=dtype
    )
    kv_cache = allocate(backend, spec, num_blocks)
    gen = torch.Generator().manual_seed(0)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    block_table = perm.view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    pos = context - 1
    slots = block_table[:, pos // bs].to(torch.int64) * bs + pos % bs
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens.clone(),
        num_reqs=batch,
        num_actual_tokens=batch,
        max_query_len=1,
        max_seq_len=context,
        block_table_tensor=block_table,
        slot_mapping=slots,
        causal=True,
    )
    with set_current_vllm_config(vllm_config):
        impl = backend.get_impl_cls()(
            num_heads=args.heads,
            head_size=args.head_size,
            scale=args.head_size**-0.5,
            num_kv_heads=args.kv_heads,
        )
    builder = backend.get_builder_cls()(spec, ["layer.0"], vllm_config, torch.device("cpu"))
    q = torch.randn(batch, args.heads, args.head_size, generator=gen).to(dtype)
    k = torch.randn(batch, args.kv_heads, args.head_size, generator=gen).to(dtype)
    v = torch.randn(batch, args.kv_heads, args.head_size, generator=gen).to(dtype)
    out = torch.empty_like(q)

    def layer(md) -> None:
        impl.forward(None, q, k, v, kv_cache, md, output=out)

    with torch.inference_mode():
        md = builder.build(0, common)
        for _ in range(3):  # compiles (compiled mode) and warms caches
            layer(md)
        builds, layers = [], []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            md = builder.build(0, common)
            t1 = time.perf_counter()
            layer(md)
            t2 = time.perf_counter()
            builds.append(t1 - t0)
            layers.append(t2 - t1)
    stat = min if args.stat == "min" else statistics.median
    return stat(builds) * 1e6, stat(layers) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--layouts", nargs="+", default=["token_major", "head_major"])
    parser.add_argument("--modes", nargs="+", default=["compiled", "eager"])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--stat",
        choices=("median", "min"),
        default="median",
        help="statistic over --iters (min is the robust one on a shared, loaded machine)",
    )
    parser.add_argument("--json", help="write the rows here as JSON")
    parser.add_argument("--markdown", help="write a markdown report here")
    args = parser.parse_args(argv)

    os.environ.setdefault("SPYRE_DEVICE_TARGET", "cpu")
    torch.set_num_threads(args.threads)
    from spyre_inference.attention.backends.head_major import SpyreHeadMajorAttentionBackend
    from spyre_inference.attention.backends.token_major import SpyreAttentionBackend
    from spyre_inference.platform import settings

    configs = {mode: make_config(args, enforce_eager=mode == "eager") for mode in args.modes}
    runs = []
    for layout in args.layouts:
        for batched in (True, False):
            if layout == "head_major" and batched:
                continue  # no batched-decode kernel on this layout
            for mode in args.modes:
                if layout == "head_major" and mode == "eager":
                    continue  # always compiled
                runs.append((layout, batched, mode))

    rows: list[Row] = []
    print(
        f"# attention per decode step: {args.heads}/{args.kv_heads} heads x {args.head_size}, "
        f"{args.dtype}, block {args.block_size}, {args.threads} threads, "
        f"{args.layers} layers, {args.stat} of {args.iters}",
        flush=True,
    )
    header = (
        f"{'layout':<12} {'batched':<8} {'mode':<9} {'batch':>5} {'ctx':>5} "
        f"{'build us':>9} {'layer us':>9} {'us/seq/layer':>12} {'step ms':>8}"
    )
    print(header, flush=True)
    for layout, batched, mode in runs:
        os.environ["SPYRE_BATCHED_DECODE"] = "1" if batched else "0"
        os.environ.pop("SPYRE_BATCHED_DECODE", None) if layout == "head_major" else None
        settings.reset_cache()
        backend = (
            SpyreAttentionBackend if layout == "token_major" else SpyreHeadMajorAttentionBackend
        )
        for context in args.context:
            for batch in args.batch:
                build_us, layer_us = measure(args, backend, configs[mode], batch, context)
                row = Row(
                    layout,
                    batched,
                    mode,
                    batch,
                    context,
                    round(build_us, 1),
                    round(layer_us, 1),
                    round((build_us + args.layers * layer_us) / 1e3, 2),
                    round(layer_us / batch, 1),
                )
                rows.append(row)
                print(
                    f"{layout:<12} {'on' if batched else 'off':<8} {mode:<9} {batch:>5} "
                    f"{context:>5} {row.build_us:>9.1f} {row.layer_us:>9.1f} "
                    f"{row.per_seq_layer_us:>12.1f} {row.step_ms:>8.2f}",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in rows], f, indent=1)
    if args.markdown:
        write_markdown(args, rows, args.markdown)
    return 0


def write_markdown(args: argparse.Namespace, rows: list[Row], path: str) -> None:
    """The rows as a report, with the machine and its load (timings on a busy host inflate)."""
    import platform as host

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        "# Attention time per decode step",
        "",
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {host.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}; load average after the run: "
        f"{load}. {args.heads} query / {args.kv_heads} KV heads x {args.head_size} "
        f"(SmolLM2-135M's attention), {args.dtype}, block {args.block_size}, "
        f"{args.threads} threads, {args.stat} of {args.iters} steps. `step ms` = metadata "
        f"build + {args.layers} layers x (KV store + attention).",
        "",
        "| layout | batched decode | mode | batch | context | build us | layer us "
        "| us/seq/layer | step ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.layout} | {'on' if r.batched_decode else 'off'} | {r.mode} | {r.batch} "
            f"| {r.context} | {r.build_us} | {r.layer_us} | {r.per_seq_layer_us} | {r.step_ms} |"
        )
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
