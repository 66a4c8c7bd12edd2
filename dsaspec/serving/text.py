"""Text in and out of the server: a checkpoint directory's tokenizer (``tokenizer.json`` through
``tokenizers``), its chat template and its stop tokens, and incremental detokenization.

Chat templates are Jinja templates, rendered in jinja2's immutable sandbox with ``messages``,
``add_generation_prompt=True``, ``bos_token``, ``eos_token`` and ``raise_exception``; a template
that does not compile is refused when the server starts, one that fails for a request is that
request's error. The template is ``chat_template.jinja`` when the directory has one, else
``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates of which
``default`` is used).
"""

from __future__ import annotations

import json
from pathlib import Path

from dsaspec.errors import UserError

TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE = "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"
GENERATION_CONFIG = "generation_config.json"


class TemplateError(ValueError):
    """A chat template that cannot render the messages of one request."""


def _token_text(value) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{file}: not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise UserError(f"{file}: expected a JSON object")
    return data


class TextCodec:
    """A tokenizer with its chat template and stop tokens.

    ``encode(text)`` gives token ids (the tokenizer's special tokens added, e.g. a BOS);
    ``chat_prompt(messages)`` the ids of the rendered chat template (no tokens added: the template
    writes them); ``decode(ids)`` text without special tokens; ``eos_token_ids`` the tokens that
    end a request unless it sets ``ignore_eos``.
    """

    def __init__(self, tokenizer, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, eos_token_ids: frozenset[int] = frozenset(), source: str = ""):
        self.tokenizer = tokenizer
        self.bos_token, self.eos_token = bos_token, eos_token
        self.eos_token_ids = eos_token_ids
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._template = None
        if chat_template is not None:
            from jinja2.exceptions import TemplateError as JinjaError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            try:
                self._template = env.from_string(chat_template)
            except JinjaError as err:
                raise UserError(f"{source}: the chat template does not compile ({err})") from None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` (dicts with ``role`` and ``content`` strings) through the chat
        template, the assistant's turn opened; ``TemplateError`` if the template fails on them."""
        if self._template is None:
            raise TemplateError("this model has no chat template (chat_template in tokenizer_config.json)")
        from jinja2.exceptions import TemplateError as JinjaError

        try:
            text = self._template.render(messages=messages, add_generation_prompt=True, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "")
        except (JinjaError, TypeError, ValueError) as err:
            raise TemplateError(f"the chat template cannot render these messages: {err}") from None
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def detokenizer(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self)


def _raise(message):
    from jinja2.exceptions import TemplateError as JinjaError

    raise JinjaError(message)


class IncrementalDetokenizer:
    """Text of a growing token list, piece by piece: :meth:`add` returns the text the new tokens
    complete. A piece that ends inside a multi-byte character (decoded as U+FFFD) is held back
    until a later token completes it, or until :meth:`flush`."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self._prefix = 0          # decoding starts here: a few tokens of context for the merges
        self._read = 0            # text of ids[:_read] has been returned

    def add(self, ids) -> str:
        self.ids.extend(ids)
        return self._piece(final=False)

    def flush(self) -> str:
        """What is still held back."""
        return self._piece(final=True)

    def _piece(self, *, final: bool) -> str:
        decode = self.codec.decode
        done = decode(self.ids[self._prefix:self._read])
        text = decode(self.ids[self._prefix:])
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(done):]


def load_text(directory: str | Path) -> TextCodec | None:
    """The :class:`TextCodec` of ``directory`` (its ``tokenizer.json``; None without one).

    The chat template comes from ``chat_template.jinja`` or ``tokenizer_config.json``; the stop
    tokens from ``generation_config.json``'s ``eos_token_id`` (an id or a list), else the
    ``eos_token`` of ``tokenizer_config.json``. ``UserError`` names a file that cannot be used.
    """
    directory = Path(directory)
    file = directory / TOKENIZER_FILE
    if not file.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as err:                       # tokenizers raises plain Exceptions for bad files
        raise UserError(f"{file}: not a tokenizers file ({err})") from None
    config = _read_json(directory / CONFIG_FILE) if (directory / CONFIG_FILE).is_file() else {}
    template = config.get("chat_template")
    source = str(directory / CONFIG_FILE)
    if (directory / TEMPLATE_FILE).is_file():
        template, source = (directory / TEMPLATE_FILE).read_text(), str(directory / TEMPLATE_FILE)
    elif isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise UserError(f"{source}: chat_template lists templates {sorted(map(str, named))} but none "
                            "named 'default', the one a chat completion uses")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise UserError(f"{source}: chat_template must be a string or a list of named templates")
    eos_token = _token_text(config.get("eos_token"))
    eos_ids: set[int] = set()
    generation = directory / GENERATION_CONFIG
    listed = _read_json(generation).get("eos_token_id") if generation.is_file() else None
    if listed is not None:
        listed = listed if isinstance(listed, list) else [listed]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in listed):
            raise UserError(f"{generation}: eos_token_id must be a token id or a list of them, got {listed!r}")
        eos_ids.update(listed)
    elif eos_token is not None:
        token = tokenizer.token_to_id(eos_token)
        if token is None:
            raise UserError(f"{directory / CONFIG_FILE}: eos_token {eos_token!r} is not in {file}")
        eos_ids.add(token)
    return TextCodec(tokenizer, chat_template=template, bos_token=_token_text(config.get("bos_token")),
                     eos_token=eos_token, eos_token_ids=frozenset(eos_ids), source=source)
