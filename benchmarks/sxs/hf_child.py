"""transformers ``generate`` (batched, greedy) for W1, W2 and the sweep; and the reference check.

Runs in the transformers venv the orchestrator creates (torch 2.13 CPU +
transformers, nothing of vLLM). Two modes:

* ``bench``: the offline workloads through ``model.generate`` with the whole
  batch at once (prompts of one workload have equal lengths, so no padding),
  greedy, end-of-sequence an ordinary token (``eos_token_id`` cleared, as
  ``ignore_eos`` does in vLLM).
* ``check``: the reference for "the outputs equal Hugging Face". Each system's
  greedy outputs are scored by the model in float32 with teacher forcing (one
  forward over prompt + generated tokens): at every generated position the
  system's token must be float32 transformers' argmax, or a near-tie with it.
  A near tie is a log-probability within ``--max-gap`` of the argmax's, or
  within transformers' own bfloat16 error at that position, whichever is
  larger: bfloat16 kernels round differently from float32 ones, and where
  transformers' own bfloat16 forward (same weights, same prefix) moves the two
  tokens' log-probability difference by more than ``--max-gap``, that position
  is a tie at bfloat16 precision and either choice is correct. (Measured on
  this machine: over the 32 W2 sequences teacher-forced, transformers'
  bfloat16 forward itself puts a token up to 0.73 nats below float32's argmax,
  so a fixed 0.5-nat line alone fails transformers too.) A wrong kernel picks
  tokens several nats below the argmax at many positions, where bfloat16
  moves log-probabilities by hundredths of a nat.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as wl


def _load(model_dir: str, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    # Greedy, no early stop: the end-of-sequence token is an ordinary token.
    cfg = model.generation_config
    cfg.eos_token_id = None
    cfg.do_sample = False
    cfg.temperature = cfg.top_p = cfg.top_k = None
    if cfg.pad_token_id is None:
        cfg.pad_token_id = model.config.pad_token_id or 0
    return model


def _generate(
    model: Any, prompts: list[list[int]], new_tokens: int, cap_s: float | None = None
) -> tuple[float, list | None]:
    """``(seconds, new token ids)``; ``(cap_s, None)`` when ``generate`` hit its time cap."""
    import torch

    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            max_time=cap_s,
        )
    elapsed = time.perf_counter() - start
    tokens = out[:, ids.shape[1] :].tolist()
    if any(len(t) != new_tokens for t in tokens):
        if cap_s is not None and elapsed >= cap_s:
            return cap_s, None
        raise SystemExit(f"generate returned {[len(t) for t in tokens]} tokens, not {new_tokens}")
    return elapsed, tokens


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    model = _load(args.model, args.dtype)
    _generate(model, wl.W1.prompts(), 4)  # warm-up
    _generate(model, wl.W2.prompts()[:4], 4)
    result: dict[str, Any] = {
        "system": args.label or f"transformers-{args.dtype}",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_before": os.getloadavg(),
    }

    timings, outputs = wl.measure(
        functools.partial(_generate, model),
        runs_w1=args.runs_w1,
        runs_w2=args.runs_w2,
        runs_sweep=args.runs_sweep,
        budget_s=args.budget_s,
        cap_s=args.cap_s,
    )
    result.update(timings)
    result["load_after"] = os.getloadavg()
    result["outputs"] = outputs
    result["medians"] = wl.medians(result)
    return result


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Score every system's outputs against float32 transformers (teacher forcing)."""
    import torch

    torch.set_num_threads(args.threads)
    model = _load(args.model, "float32")
    bf16: list[Any] = []  # loaded on first use: only sequences with a wide gap need it

    def bf16_model() -> Any:
        if not bf16:
            bf16.append(_load(args.model, "bfloat16"))
        return bf16[0]

    prompts = {"W1": wl.W1.prompts(), "W2": wl.W2.prompts()}
    systems = json.loads(Path(args.outputs).read_text())
    report: dict[str, Any] = {"max_gap": args.max_gap, "systems": {}}
    for system, outputs in systems.items():
        per_workload = {}
        for name, generated in outputs.items():
            per_workload[name] = _score(model, bf16_model, prompts[name], generated, args.max_gap)
        report["systems"][system] = per_workload
    return report


def _teacher_forced_logprobs(model: Any, seqs: Any, plen: int, gen_len: int) -> Any:
    """Log-probabilities (float32) at the positions that predict the generated tokens."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=seqs).logits.float()
    # Position plen-1+i predicts generated token i.
    return torch.log_softmax(logits[:, plen - 1 : plen - 1 + gen_len], dim=-1)


def _score(
    model: Any,
    bf16_model: Any,
    prompts: list[list[int]],
    generated: list[list[int]],
    max_gap: float,
) -> dict[str, Any]:
    import torch

    seqs = torch.tensor([p + g for p, g in zip(prompts, generated, strict=True)])
    plen = len(prompts[0])
    gen_len = len(generated[0])
    logprobs = _teacher_forced_logprobs(model, seqs, plen, gen_len)
    chosen = torch.tensor(generated)
    chosen_lp = logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
    best_lp, best = logprobs.max(dim=-1)
    gaps = best_lp - chosen_lp
    worst = int(gaps.argmax())

    # Positions past the fixed line: how far does transformers' own bfloat16
    # forward move the (argmax, chosen) log-probability difference there?
    wide = (gaps > max_gap).nonzero().tolist()
    wide_positions = []
    wrong = 0
    if wide:
        rows = sorted({r for r, _ in wide})
        lp16 = _teacher_forced_logprobs(bf16_model(), seqs[rows], plen, gen_len)
        for r, i in wide:
            b, c = int(best[r, i]), int(chosen[r, i])
            gap16 = float(lp16[rows.index(r), i, b] - lp16[rows.index(r), i, c])
            bf16_error = abs(gap16 - float(gaps[r, i]))
            is_wrong = float(gaps[r, i]) > max(max_gap, bf16_error)
            wrong += is_wrong
            wide_positions.append(
                {
                    "at": [r, i],
                    "gap": round(float(gaps[r, i]), 4),
                    "gap_bf16_transformers": round(gap16, 4),
                    "bf16_error": round(bf16_error, 4),
                    "wrong": is_wrong,
                }
            )
    return {
        "tokens": int(chosen.numel()),
        "argmax_equal": int((best == chosen).sum()),
        "near_ties": int((best != chosen).sum()) - wrong,
        "beyond_max_gap": len(wide),
        "wrong": wrong,
        "max_gap": round(float(gaps.max()), 4),
        "worst_at": [worst // gen_len, worst % gen_len],
        "beyond_max_gap_positions": wide_positions,
        "sequences_all_argmax": int((best == chosen).all(dim=-1).sum()),
        "sequences": len(generated),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("bench", "check"))
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--runs-w1", type=int, default=5)
    parser.add_argument("--runs-w2", type=int, default=3)
    parser.add_argument("--runs-sweep", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=600)
    parser.add_argument("--cap-s", type=float, default=900)
    parser.add_argument("--label")
    parser.add_argument("--outputs", help="check: JSON {system: {workload: token ids}}")
    parser.add_argument("--max-gap", type=float, default=0.5)
    args = parser.parse_args()
    result = bench(args) if args.mode == "bench" else check(args)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
