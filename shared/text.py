"""Generated text: incremental detokenization and stop strings.

The engine and the router run the same two pieces over the same tokens, so they agree on where a
stop string ends: the engine stops generating at the token that completes one (its pages go back at
once), and the router cuts the text it streams at the stop string, never sending text past it.
"""

from __future__ import annotations

from shared.model.tokenizer import Tokenizer


class Detokenizer:
    """Incremental text deltas that never split a UTF-8 character.

    Decodes only a short window: ``ids[prefix:read]`` is text already sent, ``ids[prefix:]`` the window
    with the new tokens; the delta is their difference. A window ending in U+FFFD (an incomplete byte
    sequence) is held back until the next token completes it, or flushed as is on the final push.
    Decoding from ``prefix`` rather than from the new tokens alone keeps tokenizers that strip a leading
    space (SentencePiece) right.
    """

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = self.read = 0

    def push(self, ids: list[int], final: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        self.ids += ids
        sent = self.tokenizer.decode(self.ids[self.prefix:self.read])
        window = self.tokenizer.decode(self.ids[self.prefix:])
        if not final and (window.endswith("\ufffd") or len(window) <= len(sent)):
            return ""
        delta = window[len(sent):]
        self.prefix, self.read = self.read, len(self.ids)
        return delta


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The stop string of ``stops`` that ends first in ``text`` (the longest of those ending there) and
    where it starts; None when none occurs."""
    best = None
    for s in stops:
        at = text.find(s)
        if at < 0:
            continue
        end = at + len(s)
        if best is None or (end, -len(s)) < (best[0] + len(best[1]), -len(best[1])):
            best = (at, s)
    return best


def partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of a stop string: the text
    that could still begin one and must be held back."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class StopStrings:
    """A generation's text cut at its first stop string.

    ``feed`` takes each text delta and returns the text that may be released now: everything before a
    stop string (the stop string too with ``include``), holding back only a tail that could still begin
    one. After a match it returns nothing more. A match may span any number of deltas (token
    boundaries) and end inside a delta of many tokens.
    """

    def __init__(self, stops: tuple[str, ...], include: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self.held = ""  # released later, or dropped by a match
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, delta: str, final: bool = False, match: bool = True) -> str:
        """The text ``delta`` releases; with ``match`` off (before min_tokens) nothing is matched or held."""
        if self.matched is not None:
            return ""
        text = self.held + delta
        if not match:
            self.held = ""
            return text
        hit = first_stop(text, self.stops)
        if hit is not None:
            at, self.matched = hit
            self.held = ""
            return text[:at + len(self.matched) if self.include else at]
        keep = 0 if final else partial_stop_len(text, self.stops)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep]


class TextStream:
    """A generation's text as it streams: detokenized, cut at the first stop string. The engine pushes
    one token at a time (the token that completes a stop string ends the request), the router the
    tokens of each message it relays; both see the same text."""

    def __init__(self, tokenizer: Tokenizer | None, stops: tuple[str, ...] = (), include: bool = False,
                 min_tokens: int = 0):
        self.detok = Detokenizer(tokenizer)
        self.stops = StopStrings(stops, include)
        self.min_tokens = min_tokens  # stop strings count from the output's min_tokens-th token on
        self.text = ""  # everything released so far

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, once one did."""
        return self.stops.matched

    def push(self, ids: list[int], final: bool = False) -> str:
        """The text ``ids`` release (a final push flushes whatever was held back). Token by token, so
        the engine (one token at a time) and the router (a message's run) match at the same token."""
        out = ""
        for i, tok in enumerate(ids or [None]):
            n = len(self.detok.ids) + (tok is not None)
            last = final and i == max(len(ids), 1) - 1
            delta = self.detok.push([] if tok is None else [tok], last)
            out += self.stops.feed(delta, last, n >= self.min_tokens)
        self.text += out
        return out
