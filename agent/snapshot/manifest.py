"""The manifest envelope: msgpack, SHA-256 for corruption, HMAC-SHA256 for tampering.

The file ``manifest.msgpack`` is one msgpack map ``{"magic", "format_version", "body", "sha256",
"hmac"}`` where ``body`` is the msgpack of :meth:`Manifest.to_dict`.  Reading checks the file
size against MAX_MANIFEST_BYTES before reading it, decodes with msgpack's length limits (so a
hostile length prefix cannot make it allocate) and then validates every field.
"""

from __future__ import annotations

import hashlib
import hmac as hmac_mod
import os
from pathlib import Path

import msgpack

from agent.errors import SnapshotCorrupt, SnapshotIncompatible, SnapshotNotFound, SnapshotTampered
from agent.snapshot.format import (FORMAT_VERSION, MAGIC, MANIFEST_NAME, MAX_ENTRIES,
                                   MAX_MANIFEST_BYTES, Manifest, manifest_from_dict)

_BODY_LIMITS = dict(max_str_len=1 << 20, max_bin_len=1 << 20, max_array_len=MAX_ENTRIES,
                    max_map_len=1 << 16, max_ext_len=0, strict_map_key=True)


def encode_manifest(manifest: Manifest, key: bytes | None = None) -> bytes:
    """The bytes of ``manifest.msgpack`` for ``manifest``, signed when ``key`` is given."""
    body = msgpack.packb(manifest.to_dict(), use_bin_type=True)
    return msgpack.packb({
        "magic": MAGIC, "format_version": FORMAT_VERSION, "body": body,
        "sha256": hashlib.sha256(body).digest(),
        "hmac": hmac_mod.new(key, body, hashlib.sha256).digest() if key else None,
    }, use_bin_type=True)


def decode_manifest(data: bytes, path: Path | str | None = None, key: bytes | None = None) -> Manifest:
    """Parse and check the envelope and the manifest inside it.

    With ``key``, the envelope must carry a matching HMAC.  Raises SnapshotTampered (digest or
    signature), SnapshotIncompatible (another format version), SnapshotCorrupt (anything else),
    each naming ``path`` and the expected and actual values.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise SnapshotCorrupt(f"{path}: manifest is {len(data)} bytes, limit {MAX_MANIFEST_BYTES}",
                              path=path, chunk=None, tensors=[], expected=MAX_MANIFEST_BYTES, actual=len(data))
    try:
        env = msgpack.unpackb(data, raw=False, max_str_len=64, max_bin_len=MAX_MANIFEST_BYTES,
                              max_array_len=0, max_map_len=8, max_ext_len=0)
    except Exception as exc:  # msgpack raises ValueError, TypeError and its own errors
        raise SnapshotCorrupt(f"{path}: manifest envelope is not valid msgpack: {exc}", path=path,
                              chunk=None, tensors=[], expected="msgpack map", actual=str(exc)) from exc
    if not isinstance(env, dict) or env.get("magic") != MAGIC:
        got = env.get("magic") if isinstance(env, dict) else type(env).__name__
        raise SnapshotCorrupt(f"{path}: not a rewarm manifest: magic expected {MAGIC!r}, got {got!r}",
                              path=path, chunk=None, tensors=[], expected=MAGIC, actual=got)
    if env.get("format_version") != FORMAT_VERSION:
        raise SnapshotIncompatible(
            f"{path}: pin format_version differs: snapshot {env.get('format_version')!r}, "
            f"machine {FORMAT_VERSION}", path=path,
            mismatches={"format_version": (env.get("format_version"), FORMAT_VERSION)})
    body, digest, sig = env.get("body"), env.get("sha256"), env.get("hmac")
    if not isinstance(body, bytes) or not isinstance(digest, bytes):
        raise SnapshotCorrupt(f"{path}: envelope body/sha256 must be bytes, got "
                              f"{type(body).__name__}/{type(digest).__name__}", path=path, chunk=None,
                              tensors=[], expected="bytes", actual=type(body).__name__)
    actual = hashlib.sha256(body).digest()
    if not hmac_mod.compare_digest(actual, digest):
        raise SnapshotTampered(f"{path}: manifest SHA-256 expected {digest.hex()}, got {actual.hex()}",
                               path=path, chunk=None, tensors=[], expected=digest.hex(), actual=actual.hex())
    if key is not None:
        want = hmac_mod.new(key, body, hashlib.sha256).digest()
        if not isinstance(sig, bytes) or not hmac_mod.compare_digest(want, sig):
            got = sig.hex() if isinstance(sig, bytes) else sig
            raise SnapshotTampered(f"{path}: manifest HMAC-SHA256 does not verify under the node key "
                                   f"(expected {want.hex()}, got {got})", path=path, chunk=None,
                                   tensors=[], expected=want.hex(), actual=got)
    try:
        decoded = msgpack.unpackb(body, raw=False, **_BODY_LIMITS)
    except Exception as exc:
        raise SnapshotCorrupt(f"{path}: manifest body is not valid msgpack: {exc}", path=path,
                              chunk=None, tensors=[], expected="msgpack map", actual=str(exc)) from exc
    return manifest_from_dict(decoded, path)


def read_manifest(path: Path | str, key: bytes | None = None) -> Manifest:
    """Read and check ``<path>/manifest.msgpack`` (``path`` is the snapshot directory).

    Raises SnapshotNotFound when there is no ready snapshot at ``path`` and the errors of
    :func:`decode_manifest`.  The size is checked before the file is read.
    """
    mpath = Path(path) / MANIFEST_NAME
    try:
        with open(mpath, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_MANIFEST_BYTES:
                raise SnapshotCorrupt(f"{mpath}: manifest is {size} bytes, limit {MAX_MANIFEST_BYTES}",
                                      path=mpath, chunk=None, tensors=[], expected=MAX_MANIFEST_BYTES,
                                      actual=size)
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError as exc:
        raise SnapshotNotFound(f"no ready snapshot at {path}: {mpath} does not exist", path=path) from exc
    return decode_manifest(data, mpath, key)
