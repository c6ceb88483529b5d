"""A small byte-level BPE tokenizer for the tiny test models.

Trained with the ``tokenizers`` library on :data:`~._corpus.CORPUS`, a string
committed in this package, so it needs no download and gives the same
``tokenizer.json`` on every machine (training takes about 15 ms). Byte-level
means any text, including characters the corpus never saw, encodes without an
unknown token, which keeps random test prompts and detokenisation round-trips
exact.

The vocabulary is 1000 tokens on purpose: it is not a multiple of the 64-element
Spyre stick, so the embedding and LM-head padding paths are exercised by every
tiny model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

#: Bump when the corpus, the special tokens or the trainer settings change.
TOKENIZER_VERSION = 1

#: Number of tokens, special tokens included (what ``len(tokenizer)`` returns).
VOCAB_SIZE = 1000

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
MASK_TOKEN = "<|mask|>"
#: Special tokens in id order: pad=0, bos=1, eos=2, mask=3, then chat roles.
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN,
    BOS_TOKEN,
    EOS_TOKEN,
    MASK_TOKEN,
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
)
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2
MASK_TOKEN_ID = 3

#: Turns are ``<|role|>\n{content}<|eos|>\n``; the generation prompt opens an
#: assistant turn. The end of a turn is the eos token, so a chat reply stops
#: at eos in vLLM and in transformers alike. The template writes the bos
#: token itself because chat prompts are tokenized without special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TokenizerStyle = Literal["decoder", "encoder"]


def _train_backend():  # -> tokenizers.Tokenizer (import kept lazy)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from spyre_inference.testing._corpus import CORPUS

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        # min_frequency 1: the corpus is only a few KB, and 2 would stop the
        # merges at about 640 tokens.
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:  # the corpus became too small for the target
        raise RuntimeError(
            f"test tokenizer trained to {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}"
        )
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(token) == expected_id, token
    return tok


def build_tokenizer(
    style: TokenizerStyle = "decoder", model_max_length: int = 1024
):  # -> PreTrainedTokenizerFast
    """Train the test tokenizer and wrap it as a transformers fast tokenizer.

    ``style="decoder"`` prepends bos to every encoded text (Llama convention)
    and returns only ``input_ids``/``attention_mask``, as causal LMs expect.
    ``style="encoder"`` frames texts BERT-style, ``bos A eos`` and for pairs
    ``bos A eos B eos`` with token type 1 on the second segment, and returns
    ``token_type_ids`` (bos doubles as CLS, eos as SEP), so cross-encoder and
    embedding paths see real segment ids.
    """
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _train_backend()
    if style == "decoder":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
        )
        input_names = ["input_ids", "attention_mask"]
        extra: dict[str, str] = {}
    elif style == "encoder":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A {EOS_TOKEN}",
            pair=f"{BOS_TOKEN} $A {EOS_TOKEN} $B:1 {EOS_TOKEN}:1",
            special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID), (EOS_TOKEN, EOS_TOKEN_ID)],
        )
        input_names = ["input_ids", "token_type_ids", "attention_mask"]
        extra = {"cls_token": BOS_TOKEN, "sep_token": EOS_TOKEN, "mask_token": MASK_TOKEN}
    else:
        raise ValueError(f"unknown tokenizer style {style!r}; use 'decoder' or 'encoder'")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_input_names=input_names,
        model_max_length=model_max_length,
        **extra,
    )


def save_tokenizer(
    out_dir: str | os.PathLike[str],
    style: TokenizerStyle = "decoder",
    model_max_length: int = 1024,
) -> Path:
    """Write the test tokenizer's files (tokenizer.json, config, chat template)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(style, model_max_length).save_pretrained(out)
    return out
