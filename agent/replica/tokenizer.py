"""Text in and out: a byte-level BPE (GPT-2 style) from the ``tokenizers`` library.

At import (:func:`build_from_gguf`) the tokenizer is built from the GGUF vocabulary
(``tokenizer.ggml.tokens``), merges (``tokenizer.ggml.merges``) and token types (type 3 =
control, i.e. special tokens such as ``<|im_start|>``), and saved as ``tokenizer.json`` in the
Hugging Face directory; :func:`load_tokenizer` reads it back.  The pre-tokenizer splits digits
one by one and then applies GPT-2's byte-level regex, as SmolLM2's own tokenizer does
(llama.cpp's ``smollm`` pre-tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from agent.errors import InvalidCheckpoint, ProtocolError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CONTROL = 3
"""GGUF token type of control (special) tokens (llama.cpp ``LLAMA_TOKEN_TYPE_CONTROL``)."""


def build_from_gguf(tokens: Sequence[str], merges: Sequence[str],
                    token_types: Sequence[int] | None = None) -> Tokenizer:
    """A byte-level BPE over ``tokens`` (id = index) and ``merges`` ("a b" strings, ranked).

    Raises InvalidCheckpoint for a duplicate token or a malformed merge.
    """
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        if text in vocab:
            raise InvalidCheckpoint(f"GGUF vocabulary: token {text!r} at id {i} duplicates id {vocab[text]}",
                                    path=None, field="tokenizer.ggml.tokens", value=i, limit=vocab[text])
        vocab[text] = i
    pairs = []
    for rank, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise InvalidCheckpoint(f"GGUF merges: entry {rank} {merge!r} is not two symbols",
                                    path=None, field="tokenizer.ggml.merges", value=merge, limit=2)
        pairs.append((parts[0], parts[1]))
    try:
        model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    except Exception as exc:  # the library's own error, e.g. a merge naming an unknown symbol
        raise InvalidCheckpoint(f"GGUF tokenizer: {exc}", path=None, field="tokenizer.ggml.merges",
                                value=None, limit=None) from None
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    if token_types is not None:
        special = [AddedToken(tokens[i], special=True, normalized=False)
                   for i, kind in enumerate(token_types) if kind == CONTROL]
        tok.add_special_tokens(special)
    return tok


def save_tokenizer(tok: Tokenizer, model_dir: Path, *, bos: str | None, eos: str | None,
                   chat_template: str | None) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` naming bos/eos and the template."""
    tok.save(str(model_dir / TOKENIZER_FILE))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
           "add_bos_token": False, "chat_template": chat_template}
    (model_dir / TOKENIZER_CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")


def load_tokenizer(model_dir: Path | str) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` saved in ``model_dir``.  Raises InvalidCheckpoint if absent
    or unreadable."""
    path = Path(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise InvalidCheckpoint(f"{path}: no tokenizer.json (import the model with "
                                "`rewarm model import-gguf`)", path=path, field=TOKENIZER_FILE,
                                value=None, limit=None)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:     # the tokenizers library raises a bare Exception for bad JSON
        raise InvalidCheckpoint(f"{path}: not a tokenizer the tokenizers library reads ({exc})",
                                path=path, field=TOKENIZER_FILE, value=str(exc)[:200],
                                limit="a tokenizers JSON file") from None


class ChatTemplate:
    """A model's own chat template (Jinja2, ``chat_template`` in tokenizer_config.json, copied
    there from the GGUF's ``tokenizer.chat_template`` at import), rendered the way
    transformers' ``apply_chat_template`` does: a sandboxed environment with ``trim_blocks``
    and ``lstrip_blocks``, the variables ``messages``, ``add_generation_prompt``,
    ``bos_token`` and ``eos_token``, and ``raise_exception`` for templates that refuse input.
    """

    def __init__(self, source: str, *, bos_token: str | None = None,
                 eos_token: str | None = None) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise InvalidCheckpoint(f"chat template does not parse: {exc}", path=None,
                                    field="chat_template", value=str(exc),
                                    limit="a Jinja2 template") from None
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""

    def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` ([{role, content}], as validated by the protocol),
        ending with the assistant's turn opened.  Raises ProtocolError (400) when the template
        refuses them (``raise_exception``) or fails on them."""
        from jinja2 import TemplateError

        try:
            return self._template.render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as exc:
            raise ProtocolError(f"messages: the model's chat template refused them: {exc}",
                                field="messages", value=len(messages),
                                limit="what the chat template accepts") from None
        except Exception as exc:   # the template's own Python error (1/0, str + int, recursion)
            raise ProtocolError(f"messages: the model's chat template failed on them: "
                                f"{type(exc).__name__}: {exc}", field="messages",
                                value=len(messages), limit="what the chat template accepts"
                                ) from None


def _raise_template_error(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def load_chat_template(model_dir: Path | str) -> ChatTemplate | None:
    """The chat template saved with the model in ``model_dir`` (None when the model has none).
    Raises InvalidCheckpoint for an unreadable tokenizer_config.json or a template that does
    not parse."""
    path = Path(model_dir) / TOKENIZER_CONFIG_FILE
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidCheckpoint(f"{path}: unreadable: {exc}", path=path,
                                field=TOKENIZER_CONFIG_FILE, value=str(exc),
                                limit="a JSON object") from None
    source = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if not isinstance(source, str) or not source:
        return None
    return ChatTemplate(source, bos_token=cfg.get("bos_token"), eos_token=cfg.get("eos_token"))


def chat_prompt(user: str, system: str | None = None) -> str:
    """SmolLM2's ChatML form of one user turn, ready for the assistant's answer.

    Mirrors the GGUF's ``tokenizer.chat_template`` (saved in tokenizer_config.json).
    """
    system = system or "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    return (f"<|im_start|>system\n{system}<|im_end|>\n"
            f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
