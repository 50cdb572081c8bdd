"""Stop strings: text that ends a turn besides the EOS token (a tool call's closing tag).

A stop string can span several tokens and a token can hold more than it, so it is looked for in
the decoded text, never in the ids. The samplers use `StopStrings.reached` to end rows early;
the episode sampler uses `StopStrings.cut` to keep each turn exactly up to its first stop string,
whichever sampler drew it. `Stopping` tells a sampler's `generate` how rows end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from polo.generation.prompts import stop_token_ids

# Tokens decoded beyond a stop string's length: a token may decode to nothing (a special token) or
# to half a UTF-8 character, so a few extra keep a stop string that ends in such a token findable.
EXTRA_TOKENS = 4


class StopStrings:
    """The strings that end a turn, and how to find them in token ids with `tokenizer`."""

    def __init__(self, tokenizer, strings: Sequence[str]):
        strings = tuple(strings)
        if not strings or any(not isinstance(text, str) or not text for text in strings):
            raise ValueError(f"stop strings must be non-empty strings, got {strings!r}")
        self.tokenizer, self.strings = tokenizer, strings
        self.window = max(len(text) for text in strings) + EXTRA_TOKENS

    def contains(self, text: str) -> bool:
        """Return True when `text` holds one of the stop strings."""
        return any(stop in text for stop in self.strings)

    def text_end(self, text: str) -> int | None:
        """Return the index just past the first stop string in `text`, or None when it holds none."""
        ends = [text.find(stop) + len(stop) for stop in self.strings if stop in text]
        return min(ends) if ends else None

    def reached(self, ids: torch.Tensor, new_tokens: int = 1) -> torch.Tensor:
        """Return, per row of `ids` (rows, generated so far), whether its last tokens hold a stop string, (rows,) bool.

        Only the tail that the last `new_tokens` tokens could have completed a stop string in is
        decoded: a sampler that checks after every token passes 1.
        """
        tail = self.window + new_tokens - 1
        tails = self.tokenizer.batch_decode(ids[:, -tail:].tolist(), skip_special_tokens=True)
        return torch.tensor([self.contains(text) for text in tails], dtype=torch.bool, device=ids.device)

    def cut_length(self, ids: Sequence[int]) -> int | None:
        """Return the number of tokens up to and including the one that completes the first stop string, or None.

        Binary search over prefixes: once a prefix's text holds a stop string, every longer one does.
        """
        ids = list(ids)
        if not self.contains(self.tokenizer.decode(ids, skip_special_tokens=True)):
            return None
        low, high = 1, len(ids)
        while low < high:
            middle = (low + high) // 2
            if self.contains(self.tokenizer.decode(ids[:middle], skip_special_tokens=True)):
                high = middle
            else:
                low = middle + 1
        return low


@dataclass(frozen=True)
class Stopping:
    """How a sampled row ends and what it holds after: a token of `stop_ids` or one of `strings` (None: none) ends
    it, and `pad_id` fills it from there."""

    stop_ids: tuple[int, ...]
    pad_id: int
    strings: StopStrings | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_ids", tuple(self.stop_ids))  # a list is taken too; decoders are keyed on it

    @classmethod
    def of(cls, tokenizer, model, strings: StopStrings | None = None) -> Stopping:
        """Return how `model`'s rows end with `tokenizer`: its EOS ids, the tokenizer's pad id, and `strings`."""
        return cls(tuple(stop_token_ids(tokenizer, model)), tokenizer.pad_token_id, strings)
