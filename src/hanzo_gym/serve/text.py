"""Tokens → the text a client sees, one token at a time: the same code builds a streamed completion's deltas
and a whole completion's text, so the two always agree.

OpenAI's semantics: the token that ends a turn (eos, the renderer's end-of-turn) is not text, and a stop string
ends the text just before it. While streaming, text that could be the start of a stop string is held back
until the next tokens show whether it is one.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Sequence

from transformers import PreTrainedTokenizerBase


def decode(tokenizer: PreTrainedTokenizerBase, tokens: Sequence[int]) -> str:
    # Exact text, as the renderers decode it: special tokens kept, no clean-up of spaces.
    return tokenizer.decode(list(tokens), skip_special_tokens=False, clean_up_tokenization_spaces=False)


class Detokenizer:
    """Text pieces of a growing token list, decoding a short window (vLLM's prefix and read offsets); a piece
    that ends in an incomplete UTF-8 character waits for the tokens that complete it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0  # window start: a few tokens of context before the unread ones
        self.read = 0  # tokens already turned into text

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.tokens):
            return ""
        before = decode(self.tokenizer, self.tokens[self.prefix : self.read])
        after = decode(self.tokenizer, self.tokens[self.prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.tokens)
        return after[len(before) :]


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the earliest stop string in `text` begins."""
    found = [index for index in (text.find(s) for s in stops) if index >= 0]
    return min(found) if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


class TextTracker:
    """One completion's text as its tokens arrive, and which tokens made the text shown so far."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_ids: Collection[int], stops: Sequence[str]):
        self.detokenizer = Detokenizer(tokenizer)
        self.stop_ids = set(stop_ids)
        self.stops = list(stops)
        self.text = ""
        self.tokens: list[int] = []  # the text's tokens (not the stop token)
        self.starts: list[int] = []  # where each token's text begins in `text`
        self.ended = False  # a stop token or stop string ended the text; later tokens are ignored
        self.cut_by_stop = False
        self.longest_stop = max((len(s) for s in self.stops), default=0)
        self.finished = False
        self.sent_chars = 0
        self.sent_tokens = 0

    def add(self, token: int) -> None:
        if self.ended or self.finished:
            return
        if token in self.stop_ids:
            self.ended = True
            self._append(self.detokenizer.flush())
            return
        self.tokens.append(token)
        self.starts.append(len(self.text))
        self._append(self.detokenizer.add(token))

    def finish(self) -> None:
        if not self.ended:
            self._append(self.detokenizer.flush())
        self.finished = True

    def _append(self, piece: str) -> None:
        if not piece:
            return
        # Only a stop string that ends in the new piece can be new: search the tail that could hold one.
        start = max(0, len(self.text) - self.longest_stop + 1)
        self.text += piece
        cut = find_stop(self.text[start:], self.stops)
        if cut is not None:
            self.text = self.text[: start + cut]
            self.ended = self.cut_by_stop = True

    def visible(self) -> str:
        """The text a client may see now (all of it once finished)."""
        if self.ended or self.finished:
            return self.text
        return self.text[: len(self.text) - held_back(self.text, self.stops)]

    def visible_tokens(self) -> int:
        """How many tokens have text in `visible()` (once finished, all but those cut off by a stop string)."""
        if (self.ended or self.finished) and not self.cut_by_stop:
            return len(self.tokens)
        return bisect.bisect_left(self.starts, len(self.visible()))

    def take(self) -> tuple[str, range]:
        """The text and token positions shown since the last call."""
        text = self.visible()
        count = max(self.visible_tokens(), self.sent_tokens)
        delta, tokens = text[self.sent_chars :], range(self.sent_tokens, count)
        self.sent_chars, self.sent_tokens = len(text), count
        return delta, tokens


def decode_with_starts(tokenizer: PreTrainedTokenizerBase, tokens: Sequence[int]) -> tuple[str, list[int]]:
    """The text of `tokens` and where each token's text begins in it, decoded as a completion's tokens are
    (tokens that each hold part of one UTF-8 character all begin where the character does)."""
    detokenizer = Detokenizer(tokenizer)
    text, starts = "", []
    for token in tokens:
        starts.append(len(text))
        text += detokenizer.add(token)
    return text + detokenizer.flush(), starts
