"""A loaded model's text side: its tokenizer and chat template, each loaded on first use.

A checkpoint may have neither (a GGUF import of weights alone, a synthetic model): a request
that needs text then gets a 400 naming the field that needed it, and one that gave token ids
is served as token ids.
"""

from __future__ import annotations

from typing import Any

from agent.errors import InvalidCheckpoint, ProtocolError


class ModelText:
    """The tokenizer and chat template of ``loaded`` (agent/replica/zygote.Loaded: its
    ``tokenizer_dir`` and ``identity``), or of nothing yet (a zygote: None)."""

    def __init__(self, loaded: Any = None) -> None:
        self.loaded = loaded
        self._tokenizer: Any = None
        self._chat_template: Any = None   # False once known absent

    def tokenizer(self) -> Any:
        """The model's tokenizer (agent/replica/tokenizer.py's ``load_tokenizer``); raises
        InvalidCheckpoint when the checkpoint has none."""
        if self._tokenizer is None:
            from agent.replica.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.loaded.tokenizer_dir or "")
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
            self._chat_template = load_chat_template(self.loaded.tokenizer_dir or "") or False
        if self._chat_template is False:
            raise ProtocolError(f"messages: model {self.loaded.identity.name!r} has no chat "
                                "template; send prompt or tokens instead", field="messages",
                                value="messages", limit="prompt or tokens")
        return self._chat_template
