"""The shape check every loader of weights runs before a tensor is adopted: a checkpoint's
tensors against the shapes its config implies (agent/replica/model.py ``hf_expected_shapes``,
``runtime_shapes``).  Used by the safetensors loader (agent/replica/weights.py), the GGUF
import and :meth:`agent.replica.model.Transformer.from_weights`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from agent.errors import InvalidCheckpoint


def check_shapes(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]],
                 *, where: str, partial: bool = False) -> None:
    """Raise InvalidCheckpoint naming the tensor and both shapes on any mismatch.

    Missing tensors are errors unless ``partial``; unexpected tensors always are.
    """
    for name, tensor in tensors.items():
        if name not in expected:
            raise InvalidCheckpoint(f"{where}: unexpected tensor {name!r} with shape "
                                    f"{tuple(tensor.shape)} (not in this config)",
                                    path=where, field=name, value=tuple(tensor.shape), limit=None)
        if tuple(tensor.shape) != tuple(expected[name]):
            raise InvalidCheckpoint(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                    f"config.json implies {tuple(expected[name])}",
                                    path=where, field=name, value=tuple(tensor.shape),
                                    limit=tuple(expected[name]))
    if not partial:
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise InvalidCheckpoint(f"{where}: missing tensor {missing[0]!r} with shape "
                                    f"{tuple(expected[missing[0]])} ({len(missing)} missing)",
                                    path=where, field=missing[0], value=None,
                                    limit=tuple(expected[missing[0]]))
