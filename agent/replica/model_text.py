"""A loaded model's text side: its tokenizer and chat template, loaded ahead of the first
request (:meth:`ModelText.preload`, or :func:`preload_tokenizer` in a zygote warmed for a
snapshot), else on first use.

Loading SmolLM2's tokenizer takes 0.11 s and its chat template 0.04 s (development machine,
quiet).  Paid inside the first request they were part of its TTFT (the first request after a
boot: 384 ms for an 8-token prompt predicted at ~30 ms), and the front door's measured slowdown (agent/frontdoor/router.py,
the 99th percentile of observed over predicted TTFT) then carried that one-off ratio of ~9
onto the next hundred predictions: long prompts that the replica serves in 1.1 s were
predicted at 7 s and refused.

A checkpoint may have neither (a GGUF import of weights alone, a synthetic model): a request
that needs text then gets a 400 naming the field that needed it, and one that gave token ids
is served as token ids.
"""

from __future__ import annotations

import threading
from typing import Any

from agent.errors import InvalidCheckpoint, ProtocolError

_PRELOADED: dict[str, Any] = {}
_PRELOAD_LOCK = threading.Lock()


def preload_tokenizer(tokenizer_dir: str) -> None:
    """Load the tokenizer in ``tokenizer_dir`` now, for every ModelText of that directory in
    this process (a zygote warmed for a snapshot calls it before it is ready).  A directory
    without one is left to the request that needs it (its 400 names the field)."""
    from agent.replica.tokenizer import load_tokenizer

    with _PRELOAD_LOCK:
        if tokenizer_dir in _PRELOADED:
            return
        try:
            _PRELOADED[tokenizer_dir] = load_tokenizer(tokenizer_dir)
        except InvalidCheckpoint:
            pass


class ModelText:
    """The tokenizer and chat template of ``loaded`` (agent/replica/zygote.Loaded: its
    ``tokenizer_dir`` and ``identity``), or of nothing yet (a zygote: None).  Thread-safe: a
    request arriving while :meth:`preload` runs waits for the same load."""

    def __init__(self, loaded: Any = None) -> None:
        self.loaded = loaded
        self._tokenizer: Any = None
        self._chat_template: Any = None   # False once known absent
        self._lock = threading.Lock()

    def preload(self) -> None:
        """Load the tokenizer and the chat template now (each absent one is left to the
        request that needs it, which gets its 400).  Run it off the event loop, once the
        replica has its model: the worker does so when it starts serving."""
        if self.loaded is None:
            return
        try:
            self.tokenizer()
        except InvalidCheckpoint:
            pass
        try:
            self.chat_template()
        except (ProtocolError, InvalidCheckpoint):
            pass

    def preload_in_background(self) -> None:
        """:meth:`preload` on a daemon thread (the worker's event loop and engine thread
        keep serving meanwhile)."""
        threading.Thread(target=self.preload, name="text-preload", daemon=True).start()

    def tokenizer(self) -> Any:
        """The model's tokenizer (agent/replica/tokenizer.py's ``load_tokenizer``); raises
        InvalidCheckpoint when the checkpoint has none."""
        if self._tokenizer is None:
            from agent.replica.tokenizer import load_tokenizer

            with self._lock:
                if self._tokenizer is None:
                    where = self.loaded.tokenizer_dir or ""
                    self._tokenizer = _PRELOADED.get(where) or load_tokenizer(where)
        return self._tokenizer

    def has_tokenizer(self) -> bool:
        """Whether the model has a tokenizer (False for a checkpoint without one)."""
        try:
            self.tokenizer()
        except InvalidCheckpoint:
            return False
        return True

    def tokenizer_for(self, field_name: str) -> Any:
        """The tokenizer, or a 400 naming ``field_name`` when the model has none."""
        try:
            return self.tokenizer()
        except InvalidCheckpoint as exc:
            raise ProtocolError(f"{field_name}: model {self.loaded.identity.name!r} has no "
                                f"tokenizer ({exc.message}); send tokens: [int] and stop "
                                "token ids instead", field=field_name, value="text",
                                limit="tokens") from exc

    def chat_template(self) -> Any:
        """The model's chat template (a 400 when it has none)."""
        from agent.replica.tokenizer import load_chat_template

        if self._chat_template is None:
            with self._lock:
                if self._chat_template is None:
                    self._chat_template = load_chat_template(self.loaded.tokenizer_dir or "") or False
        if self._chat_template is False:
            raise ProtocolError(f"messages: model {self.loaded.identity.name!r} has no chat "
                                "template; send prompt or tokens instead", field="messages",
                                value="messages", limit="prompt or tokens")
        return self._chat_template
