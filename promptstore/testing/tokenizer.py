"""A small BPE tokenizer trained in-process on text shipped with the project,
with a chat template, so demos and tests run real text through mlx-lm."""

from __future__ import annotations

import functools
from pathlib import Path

CORPUS = Path(__file__).with_name("data") / "corpus.txt"
SPECIAL = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def train_bpe(vocab_size: int, special: list[str]):
    """A byte-level BPE (a `tokenizers.Tokenizer`) of at most `vocab_size` tokens, `special` first,
    trained on the project's corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS.read_text().splitlines(), trainer=trainer)
    return bpe


@functools.lru_cache(maxsize=4)
def demo_tokenizer(vocab_size: int = 512):
    """An mlx-lm TokenizerWrapper around a byte-level BPE of `vocab_size` tokens."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(vocab_size, SPECIAL),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
    )
    return TokenizerWrapper(fast)
