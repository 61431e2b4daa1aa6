"""Stop strings, matched on the detokenized text as it is produced.

A stop string may span tokens ("\\n\\n" from two "\\n" tokens, "END" from "E" + "ND"), so the
text is never checked token by token: :class:`StopText` keeps back the longest tail of the
text that could still become a stop string (a proper prefix of one), and lets out only what
can no longer be part of a match.  When a stop string completes, the text before it is the
last let out, and nothing after it ever is (the stop string itself is not returned, as in
OpenAI's API).  Cost per piece: O(len(piece + held) x stops) string searches, where the held
tail is shorter than the longest stop string.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopText:
    """Incremental matcher of ``stops`` (non-empty strings) over text fed in pieces."""

    __slots__ = ("stops", "held", "stopped")

    def __init__(self, stops: Iterable[str] = ()) -> None:
        self.stops = tuple(s for s in stops if s)
        self.held = ""        # a tail that may begin a stop string: not let out yet
        self.stopped = False  # a stop string completed: nothing more is let out

    def feed(self, piece: str) -> str:
        """The text that may be sent now, given one more ``piece``.  After a stop string
        completes, returns the text before it and sets :attr:`stopped`; then always ""."""
        if self.stopped:
            return ""
        text = self.held + piece
        if not self.stops:
            self.held = ""
            return text
        cut = -1
        for stop in self.stops:
            at = text.find(stop)
            if at >= 0 and (cut < 0 or at < cut):
                cut = at
        if cut >= 0:
            self.stopped, self.held = True, ""
            return text[:cut]
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        self.held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        """The sequence ended without completing a stop string: the held tail goes out."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out
