"""The tokenizers a process has loaded from model folders, the most recent few kept.

Every checkpoint folder carries the run's tokenizer (training never changes it), and a stage asks for
the tokenizer of the state it uses, so a run that saves every step would load one per step and role.
Kept without bound, they would grow with the run: SmolLM2's takes 8.8 MiB, 17 GiB over 1,000 steps of
an actor and a critic.
"""

from __future__ import annotations

from collections import OrderedDict

KEPT = 8
"""A step asks for the tokenizers of a few folders (its actor's, critic's, reference's, reward
model's); eight leave room."""


class RecentTokenizers:
    def __init__(self, kept: int = KEPT):
        self._kept = kept
        self._loaded: OrderedDict[str, object] = OrderedDict()  # folder → tokenizer, least recent first

    def __len__(self) -> int:
        return len(self._loaded)

    def get(self, directory: str):
        """The tokenizer saved in `directory`, loaded once while it is among the most recent."""
        tokenizer = self._loaded.pop(directory, None)
        if tokenizer is None:
            from ppoflow.engine.models import load_tokenizer

            tokenizer = load_tokenizer(directory)
        self._loaded[directory] = tokenizer
        while len(self._loaded) > self._kept:
            self._loaded.popitem(last=False)
        return tokenizer
