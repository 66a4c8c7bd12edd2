"""A small byte-level BPE tokenizer trained on a fixed text, with a chat template: the tokenizer
of the tests' tiny checkpoints (nothing is downloaded). Needs ``tokenizers``."""

from __future__ import annotations

import json
from pathlib import Path

TEXT = ("The quick brown fox jumps over the lazy dog. A speculative decoder drafts tokens and the "
        "target model verifies them in one step; accepted tokens are committed, the rest are dropped. "
        "Sparse attention selects the top keys of every query. Hello, world! How are you today? "
        "Numbers 0 1 2 3 4 5 6 7 8 9 and punctuation: , . ; : ! ? ( ) [ ] { } - + * / = < > ") * 4

SPECIAL = ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>")
# role markers around each message, the assistant's turn opened at the end
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                 "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                 "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tokenizer(directory: str | Path, *, vocab_size: int = 320, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Train the tokenizer (``vocab_size`` ids at most, special tokens first: ``<|endoftext|>`` is
    id 0 and the EOS) and write ``tokenizer.json`` and ``tokenizer_config.json`` (with
    ``chat_template`` unless None) under ``directory``. Deterministic; returns ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([TEXT], trainer=trainer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": SPECIAL[0], "bos_token": None}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return directory


def build_word_tokenizer(directory: str | Path, vocab_size: int) -> Path:
    """Write a word-level ``tokenizer.json`` (and ``tokenizer_config.json``) of exactly
    ``vocab_size`` ids for benchmarking a random-weight model: id 0 is ``<|endoftext|>`` (the EOS),
    id ``i > 0`` the word ``w<i>``; text is the words joined by spaces. Every id but 0 decodes on
    its own to visible text and ``encode(decode(ids)) == ids``, so a client that times streamed
    chunks by their text (SGLang's ``bench_serving``) sees every token. Returns ``directory``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2, got {vocab_size!r}")
    vocab = {SPECIAL[0]: 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([SPECIAL[0]])
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIAL[0], "bos_token": None}))
    return directory
