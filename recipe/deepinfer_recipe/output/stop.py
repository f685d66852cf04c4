"""Stop strings in generated text: where the first one completes, and what must not be streamed yet.

Both users of generated text stop on strings with these rules: the engine's detokenizer
(detokenize.py, for /v1/completions and the offline LLM) and the chat output parser (parser.py,
for Chat Completions, Responses and Messages).

"Earliest" means the match that is complete first as text arrives: the smallest end position,
and among those the longest string. That choice gives the same result however the text was
split into steps, which is what makes streaming and non-streaming agree.

While generating, the streamed text withholds the longest tail that is still the start of some
stop string (`hold_back`), so a stop string, or part of one, never reaches a client in a delta
(unless include_stop_str_in_output, where it would be part of the output anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopMatch(NamedTuple):
    stop: str
    start: int   # where the stop string begins in the searched text
    end: int     # just after it


class StopChecker:
    def __init__(self, stop: str | Sequence[str] | None = None,
                 include_stop_str_in_output: bool = False) -> None:
        self.stop: list[str] = [stop] if isinstance(stop, str) else list(stop or ())
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self.include_stop_str_in_output = include_stop_str_in_output
        # hold_back runs after every token, so it looks only at the text's last character: a
        # held-back tail ends with it. For each character, the proper prefixes of the stop
        # strings that end with it, longest first (the first one the text ends with wins).
        prefixes: dict[str, set[str]] = {}
        for s in self.stop:
            for n in range(1, len(s)):
                prefixes.setdefault(s[n - 1], set()).add(s[:n])
        self._prefixes_ending_in = {ch: sorted(group, key=len, reverse=True) for ch, group in prefixes.items()}

    def find(self, text: str, num_new_chars: int | None = None) -> StopMatch | None:
        """The earliest stop string ending in the last `num_new_chars` characters of `text`
        (None: anywhere in it). Only matches that end in the new characters count: older text
        was searched in earlier calls."""
        if not self.stop:
            return None
        new_from = 0 if num_new_chars is None else len(text) - num_new_chars
        if new_from >= len(text):
            return None
        best: StopMatch | None = None
        for stop in self.stop:
            # Start far enough back that a match may straddle old and new text, but not so
            # far that a match lying wholly in old text is found.
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start == -1:
                continue
            end = start + len(stop)
            if best is None or (end, start) < (best.end, best.start):
                best = StopMatch(stop, start, end)
        return best

    def check_stop(self, text: str, num_new_chars: int) -> tuple[str | None, str]:
        """Look for a stop string ending in the last `num_new_chars` characters of `text`.

        Returns (matched stop string, text truncated before it, or after it when
        include_stop_str_in_output), or (None, text) when nothing matched.
        """
        match = self.find(text, num_new_chars) if num_new_chars > 0 else None
        if match is None:
            return None, text
        return match.stop, text[:match.end] if self.include_stop_str_in_output else text[:match.start]

    def hold_back(self, text: str) -> int:
        """How many trailing characters of `text` must not be streamed yet.

        The longest suffix that is a proper prefix of some stop string (0 when the stop
        string would be kept in the output anyway). At most max(len(stop)) - 1.
        NOTE: released text can never become part of a later match: that match would have
        to start inside the released text, making a longer suffix a stop prefix here.
        """
        if not text or self.include_stop_str_in_output:
            return 0
        for prefix in self._prefixes_ending_in.get(text[-1], ()):
            if text.endswith(prefix):
                return len(prefix)
        return 0
