"""Text ↔ token ids through the Rust `tokenizers` library, without transformers.

`Tokenizer` wraps a `tokenizers.Tokenizer` loaded from a Hugging Face `tokenizer.json`, with the
special-token names (bos / eos / pad) read from `tokenizer_config.json`, which is all the rollout
engine and reward code need. `make_char_tokenizer` builds a real one-token-per-character tokenizer
for tests and toy tasks; it saves in the same two files, so `load_tokenizer` and transformers'
`PreTrainedTokenizerFast` both read it back, and decoding reproduces text exactly (spaces and
newlines included).
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Iterable

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the names of its bos / eos / pad tokens (each optional)."""

    def __init__(
        self,
        inner: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.inner = inner
        self.chat_template = chat_template
        self._specials = {"bos_token": bos_token, "eos_token": eos_token, "pad_token": pad_token}
        self._special_ids: dict[str, int | None] = {}
        for field, token in self._specials.items():
            token_id = None if token is None else inner.token_to_id(token)
            if token is not None and token_id is None:
                raise ValueError(f"{field}: {token!r} is not in the vocabulary")
            self._special_ids[field] = token_id

    @property
    def vocab_size(self) -> int:
        return self.inner.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_ids["bos_token"]

    @property
    def eos_token_id(self) -> int | None:
        return self._special_ids["eos_token"]

    @property
    def pad_token_id(self) -> int | None:
        return self._special_ids["pad_token"]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; the tokenizer's template (e.g. a bos) only when asked."""
        try:
            return self.inner.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as e:  # tokenizers raises a bare Exception, e.g. for unknown characters
            raise ValueError(f"text: cannot be encoded ({e})") from e

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self.inner.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: list[list[int]], *, skip_special_tokens: bool = True) -> list[str]:
        return self.inner.decode_batch(batch, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.inner.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model's own chat template renders it (jinja2, sandboxed, with
        the same switches as transformers: trim_blocks, lstrip_blocks, `raise_exception`)."""
        if not self.chat_template:
            raise ValueError("messages: this model's tokenizer has no chat template (tokenizer_config.json "
                             "chat_template); give prompts as text")
        return _compiled(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **{name: token for name, token in self._specials.items() if token is not None},
        )

    def save(self, path: str | os.PathLike) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` into directory `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.inner.save(str(path / TOKENIZER_FILE))
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            **self._specials,
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        with open(path / TOKENIZER_CONFIG_FILE, "w") as f:
            json.dump(config, f, indent=2)


def load_tokenizer(dir_or_file: str | os.PathLike) -> Tokenizer:
    """Load a directory holding `tokenizer.json` (or that file itself) and, if present beside it,
    `tokenizer_config.json` for the special-token names."""
    path = Path(dir_or_file)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(
            f"{file}: no such file (expected {TOKENIZER_FILE} or a directory holding one)"
        )
    inner = tokenizers.Tokenizer.from_file(str(file))
    specials: dict[str, str | None] = {}
    template = None
    config_path = file.parent / TOKENIZER_CONFIG_FILE
    if config_path.is_file():
        with open(config_path) as f:
            config = json.load(f)
        for field in _SPECIAL_NAMES:
            token = config.get(field)
            # Older configs store an AddedToken as a dict with the text under "content".
            specials[field] = token.get("content") if isinstance(token, dict) else token
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = file.parent / "chat_template.jinja"  # transformers 5 writes it beside the config
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    return Tokenizer(inner, **specials, chat_template=template)


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def make_char_tokenizer(
    chars: str, *, specials: tuple[str, ...] = ("<pad>", "<bos>", "<eos>"), words: tuple[str, ...] = ()
) -> Tokenizer:
    """One token per character of `chars` after the special tokens (ids 0..len(specials)-1).

    The first three specials become pad, bos and eos, in that order (fewer specials leave the
    later roles unset). Characters outside `chars` make `encode` raise ValueError. `words` are
    multi-character tokens after the characters, matched before them and decoded as text (not
    skipped as specials are), as a chat model's `<tool_call>` is.
    """
    if not chars:
        raise ValueError("chars: must not be empty")
    if len(set(chars)) != len(chars):
        raise ValueError(f"chars: contains duplicates {sorted({c for c in chars if chars.count(c) > 1})!r}")
    if len(set(specials)) != len(specials) or set(specials) & set(chars):
        raise ValueError("specials: must be distinct from each other and from chars")
    if len(set(words)) != len(words) or set(words) & (set(specials) | set(chars)) or any(len(w) < 2 for w in words):
        raise ValueError("words: must be distinct, of two characters or more, and not specials")
    vocab = {token: i for i, token in enumerate([*specials, *chars, *words])}
    # WordLevel needs an unk token name; one absent from the vocab makes unknown characters an
    # error instead of silently mapping them to some real token.
    inner = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk-char>"))
    # "[\s\S]" matches every character, newlines included (tokenizers' Oniguruma regexes have
    # no "(?s)" dotall flag), so each character becomes its own word.
    inner.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    inner.decoder = decoders.Fuse()
    inner.add_special_tokens(list(specials))
    inner.add_tokens([tokenizers.AddedToken(w, normalized=False, special=False) for w in words])
    roles = dict(zip(("pad_token", "bos_token", "eos_token"), specials))
    return Tokenizer(inner, **roles)
