"""Real components with a gate, so a test can hold them at a known point and act while they wait (no timers)."""

from __future__ import annotations

import threading

from kvflow.engine.engine import LLMEngine
from kvflow.model.tokenizer import Tokenizer

GATE_TIMEOUT_S = 60.0  # a held component gives up after this, so a failing test cannot hang forever


class GatedEngine(LLMEngine):
    """A real engine that can be held: after `hold_after(n)` it runs n more steps, then blocks inside the next
    `step()` (setting `holding`) until `release()`."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._open = threading.Event()
        self._open.set()
        self._budget = 0
        self.holding = threading.Event()

    def hold_after(self, steps: int) -> None:
        self._budget = steps
        self.holding.clear()
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def step(self):
        if not self._open.is_set():
            if self._budget > 0:
                self._budget -= 1
            else:
                self.holding.set()
                self._open.wait(GATE_TIMEOUT_S)
        return super().step()


class GatedTokenizer(Tokenizer):
    """The checkpoint's real tokenizer; each encode / chat templating first signals `entered` and waits for
    `release` — a huge prompt being tokenized, for as long as the test needs."""

    def __init__(self, directory) -> None:
        super().__init__(directory)
        self.entered = threading.Event()
        self.release = threading.Event()

    def _gate(self) -> None:
        self.entered.set()
        self.release.wait(GATE_TIMEOUT_S)

    def encode(self, text: str) -> list[int]:
        self._gate()
        return super().encode(text)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> list[int]:
        self._gate()
        return super().apply_chat_template(messages, add_generation_prompt)
