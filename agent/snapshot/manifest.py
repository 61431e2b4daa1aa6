"""The manifest envelope: msgpack, SHA-256 for corruption, HMAC-SHA256 for tampering.

The file ``manifest.msgpack`` is one msgpack map ``{"magic", "format_version", "body", "sha256",
"hmac"}`` where ``body`` is the msgpack of :meth:`Manifest.to_dict`.  Reading checks the file
size against MAX_MANIFEST_BYTES before reading it, decodes with msgpack's length limits (so a
hostile length prefix cannot make it allocate) and then validates every field.

Snapshot files are opened with :func:`open_regular`: O_NOFOLLOW | O_NONBLOCK, then fstat must
say S_ISREG, so a symlink, directory, FIFO or device in a snapshot file's place is refused
with a typed error instead of being followed, read as garbage or blocking the reader.
"""

from __future__ import annotations

import hashlib
import hmac as hmac_mod
import errno
import fcntl
import os
import stat
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
    version = env.get("format_version")
    if type(version) is not int or version != FORMAT_VERSION:   # not True, not 1.0
        raise SnapshotIncompatible(
            f"{path}: pin format_version differs: snapshot {env.get('format_version')!r}, "
            f"machine {FORMAT_VERSION}", path=path,
            mismatches={"format_version": (env.get("format_version"), FORMAT_VERSION)})
    body, digest, sig = env.get("body"), env.get("sha256"), env.get("hmac")
    if not isinstance(body, bytes) or not isinstance(digest, bytes):
        raise SnapshotCorrupt(f"{path}: envelope body/sha256 must be bytes, got "
                              f"{type(body).__name__}/{type(digest).__name__}", path=path, chunk=None,
                              tensors=[], expected="bytes", actual=type(body).__name__)
    if sig is not None and not isinstance(sig, bytes):
        raise SnapshotCorrupt(f"{path}: envelope hmac must be bytes or nil, got {type(sig).__name__}",
                              path=path, chunk=None, tensors=[], expected="bytes or nil",
                              actual=type(sig).__name__)
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


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def open_regular(fpath: Path, what: str, snapshot: Path | str) -> tuple[int, os.stat_result]:
    """Open ``fpath`` read-only without following a symlink or blocking; return (fd, fstat).

    ``what`` names the file in errors ("manifest", "data file").  Raises SnapshotNotFound when
    the snapshot directory ``snapshot`` is not a directory, FileNotFoundError when ``fpath``
    does not exist (the caller knows what that means) and SnapshotCorrupt naming the path when
    it is a symlink (or a loop of them), not a regular file, or cannot be opened.  The returned
    descriptor is blocking again (O_NONBLOCK cleared) and close-on-exec.
    """
    try:
        fd = os.open(fpath, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except NotADirectoryError as exc:
        raise SnapshotNotFound(f"no snapshot at {snapshot}: not a directory ({exc.strerror})",
                               path=snapshot) from exc
    except OSError as exc:
        why = ("is a symbolic link (or a loop of them); snapshot files must be regular files"
               if exc.errno == errno.ELOOP else f"cannot be opened: {exc.strerror} (errno {exc.errno})")
        raise SnapshotCorrupt(f"{fpath}: {what} {why}", path=fpath, chunk=None, tensors=[],
                              expected="a regular file", actual=exc.strerror) from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), f"mode {st.st_mode:o}")
            raise SnapshotCorrupt(f"{fpath}: {what} is not a regular file: it is {kind}", path=fpath,
                                  chunk=None, tensors=[], expected="a regular file", actual=kind)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_manifest(path: Path | str, key: bytes | None = None) -> Manifest:
    """Read and check ``<path>/manifest.msgpack`` (``path`` is the snapshot directory).

    Raises SnapshotNotFound when there is no ready snapshot at ``path`` and the errors of
    :func:`decode_manifest`.  The size is checked before the file is read.
    """
    mpath = Path(path) / MANIFEST_NAME
    try:
        fd, st = open_regular(mpath, "manifest", path)
    except SnapshotNotFound:
        raise
    except FileNotFoundError as exc:
        raise SnapshotNotFound(f"no ready snapshot at {path}: {mpath} does not exist", path=path) from exc
    with open(fd, "rb") as f:
        if st.st_size > MAX_MANIFEST_BYTES:
            raise SnapshotCorrupt(f"{mpath}: manifest is {st.st_size} bytes, limit {MAX_MANIFEST_BYTES}",
                                  path=mpath, chunk=None, tensors=[], expected=MAX_MANIFEST_BYTES,
                                  actual=st.st_size)
        try:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        except OSError as exc:
            raise SnapshotCorrupt(f"{mpath}: manifest cannot be read: {exc.strerror} (errno {exc.errno})",
                                  path=mpath, chunk=None, tensors=[], expected="readable",
                                  actual=exc.strerror) from exc
    return decode_manifest(data, mpath, key)
