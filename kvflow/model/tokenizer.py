"""The checkpoint's own tokenizer and chat template (transformers' fast tokenizer), plus incremental detokenization."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

Message = dict[str, Any]


class Tokenizer:
    """Text <-> token ids exactly as the checkpoint's `transformers` tokenizer does it."""

    def __init__(self, directory: str | Path) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        self.directory = Path(directory)
        self.hf = AutoTokenizer.from_pretrained(str(directory))
        self.vocab_size = len(self.hf)

    @staticmethod
    def available(directory: str | Path) -> bool:
        d = Path(directory)
        return (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Raw prompt -> ids; special tokens written in the text are parsed as special tokens."""
        return list(self.hf(text)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError(f"the tokenizer in {self.directory} has no chat template; pass a raw prompt instead")
        validate_messages(messages)
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        # The template already wrote any BOS it wants; do not add another.
        return list(self.hf(text, add_special_tokens=False)["input_ids"])


def validate_messages(messages: list[Message]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"messages[{i}] has unknown role {m['role']!r}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}].content must be a string")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters.

    Decodes a small window (from `prefix` to the end) and emits only what is new since `read`;
    holds text back while it ends in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read], self.skip)
        full = self.tok.decode(self.ids[self.prefix :], self.skip)
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return delta
        return ""
