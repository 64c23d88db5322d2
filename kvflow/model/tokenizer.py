"""The checkpoint's own tokenizer and chat template (transformers' fast tokenizer), plus incremental detokenization."""

from __future__ import annotations

import os
import re
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
        specials = sorted({t.content for t in self.hf.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
        self._specials_re = re.compile("|".join(map(re.escape, specials))) if specials else None  # special-token text
        # decoding straight through the fast tokenizer's backend where transformers' `decode` would do just
        # that (no clean-up of spaces): it is called twice per generated token, and transformers' own
        # argument conversion costs several times the backend's decode
        backend = getattr(self.hf, "_tokenizer", None)
        self._backend_decode = backend.decode if backend is not None and not self.hf.clean_up_tokenization_spaces else None

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
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        """Render the checkpoint's chat template and tokenize it. Message content is plain text: special-token
        text typed into it (e.g. "<|im_start|>system") is tokenized as ordinary characters, never as the special
        token, so a client cannot forge turns; the template's own special tokens are real. (transformers'
        `apply_chat_template(tokenize=True)` and vLLM parse such text as special tokens.) Content without
        special-token text tokenizes exactly as transformers does."""
        if not self.hf.chat_template:
            raise ValueError(f"the tokenizer in {self.directory} has no chat template; pass a raw prompt instead")
        validate_messages(messages)
        escaped, literals, marker = self._escape_specials(messages)
        text = self.hf.apply_chat_template(escaped, tokenize=False, add_generation_prompt=add_generation_prompt)
        if not literals:  # The template already wrote any BOS it wants; do not add another.
            return list(self.hf(text, add_special_tokens=False)["input_ids"])
        return self._encode_with_literals(text, literals, marker)

    def _escape_specials(self, messages: list[Message]) -> tuple[list[Message], list[str], str]:
        """Replace special-token text in each content by `marker + index + marker` (a private-use character
        no message and no template contains), so the template renders it as inert text."""
        pattern = self._specials_re
        literals: list[str] = []
        if pattern is None or not any(pattern.search(m["content"]) for m in messages):
            return messages, literals, ""
        used = "".join(m["content"] for m in messages) + self.hf.chat_template
        marker = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)

        def hide(match: re.Match) -> str:
            literals.append(match.group(0))
            return f"{marker}{len(literals) - 1}{marker}"

        return [{**m, "content": pattern.sub(hide, m["content"])} for m in messages], literals, marker

    def _encode_with_literals(self, text: str, literals: list[str], marker: str) -> list[int]:
        """Tokenize `text` as transformers would, except that each hidden literal is plain text: the pieces between
        the template's special tokens are encoded with special-token parsing off (HF tokenizes those pieces
        independently anyway, so the template's tokens come out the same)."""
        enc = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        special_ids = {i for i, t in self.hf.added_tokens_decoder.items() if t.special}
        unhide = re.compile(re.escape(marker) + r"(\d+)" + re.escape(marker))
        ids: list[int] = []
        cursor = 0

        def plain(piece: str) -> None:
            piece = unhide.sub(lambda m: literals[int(m.group(1))], piece)
            if piece:
                ids.extend(self.hf(piece, add_special_tokens=False, split_special_tokens=True)["input_ids"])

        for tid, (start, end) in zip(enc["input_ids"], enc["offset_mapping"]):
            if tid in special_ids:
                plain(text[cursor:start])
                ids.append(tid)
                cursor = end
        plain(text[cursor:])
        return ids


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
