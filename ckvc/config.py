"""The repository config (``.ckvc/config.json``, a Backend key) and its version rule."""

from __future__ import annotations

import contextlib
import json
import math
import os
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckvc.chunking import DEFAULT_CHUNK_SIZE, validate_chunk_size
from ckvc.codecs.codec_ids import ENCODER_NAMES, MAX_AGE
from ckvc.errors import (
    CkvcError,
    DurabilityWarning,
    InvalidConfigError,
    StorageError,
    UnsupportedFormatError,
    storage_errors,
)
from ckvc.refs import REFS_LOCK
from ckvc.storage.backend import Backend
from ckvc.storage.local import backend_at
from ckvc.storage.object_store import DEFAULT_MAX_PACK_SIZE

FORMAT_VERSION = 4
# Older repositories are read and written as they are; a writer raises the version
# only before it writes what the older one lacks (docs/FORMAT.md, section 15).
READABLE_VERSIONS = (1, 2, 3, 4, 5)
CODECS_VERSION = 2  # codecs 2-5, the lossy commit field
FILES_VERSION = 3  # file nodes (state ext 10), JSON-like commit metadata
CODECS4_VERSION = 4  # Huffman planes, scaled deltas; older repositories keep the version 3 codecs
COMPACT_VERSION = 5  # the compact lossy tier: lossy chains, powers of two, Huffman-coded codes
DEFAULT_KEYFRAME_INTERVAL = 16
HASH_NAME = "blake3-256"
CONFIG_NAME = "config.json"
# zstd's range: negative levels are its fast modes; 22 is its maximum.
MIN_CODEC_LEVEL, MAX_CODEC_LEVEL = -7, 22


@dataclass
class RepoConfig:
    format_version: int = FORMAT_VERSION
    repo_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    hash: str = HASH_NAME
    chunk_size: int = DEFAULT_CHUNK_SIZE
    codec: dict[str, Any] = field(default_factory=lambda: {"name": "auto", "level": 1})
    max_pack_size: int = DEFAULT_MAX_PACK_SIZE
    default_branch: str = "main"
    # Lifecycle (docs/GUIDE.md): reflog entries younger than this keep their commits;
    # gc never touches packs younger than the grace period (unless --now); it
    # rewrites packs whose live fraction is below the repack threshold.
    reflog_expiry_s: float = 90 * 86400
    gc_grace_s: float = 3600
    repack_threshold: float = 0.8
    retention: dict[str, Any] | None = None
    # A tensor's chunk is stored whole at least every this many commits and as a
    # delta against that keyframe in between (1: no deltas). Chosen by
    # benchmarks/compression.py, stored size against drift (docs/DESIGN.md).
    keyframe_interval: int = DEFAULT_KEYFRAME_INTERVAL

    def validate(self) -> RepoConfig:
        """Check every field's type and range; a ValueError names the key."""
        for key, kinds in _FIELD_TYPES.items():
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, kinds):
                names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
                raise ValueError(f"{key} must be {names}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{key} must be finite, got {value!r}")
        try:
            validate_chunk_size(self.chunk_size)
        except ValueError as exc:
            raise ValueError(f"chunk_size: {exc}") from None
        _validate_codec(self.codec)
        if self.max_pack_size < 1 << 20:
            raise ValueError("max_pack_size must be at least 1 MiB")
        if not 0.0 <= self.repack_threshold <= 1.0:
            raise ValueError("repack_threshold must be between 0 and 1")
        if not 1 <= self.keyframe_interval <= MAX_AGE:
            raise ValueError(f"keyframe_interval must be between 1 and {MAX_AGE}")
        if self.format_version < 2 and self.codec.get("name") not in ("raw", "zstd"):
            raise ValueError(f"codec {self.codec.get('name')!r} needs repository format version 2")
        if self.reflog_expiry_s < 0 or self.gc_grace_s < 0:
            raise ValueError("reflog_expiry_s and gc_grace_s must not be negative")
        if self.retention is not None:
            from ckvc.retention_policy import RetentionPolicy

            try:
                RetentionPolicy.from_config(self.retention)
            except (CkvcError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"retention: {exc}") from None
        return self

    def encoded(self) -> bytes:
        """The bytes of config.json."""
        return (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode()

    def save(self, target: Backend | str | os.PathLike[str]) -> None:
        """Write the config atomically to a Backend or a ``.ckvc`` directory."""
        backend = backend_at(target)
        data = self.encoded()
        # Under the refs lock, as every writer of the repository's small mutable
        # files: so a ref update may remove what a failed config write left.
        lock = backend.lock(REFS_LOCK) if backend.capabilities.file_locks else contextlib.nullcontext()
        with storage_errors("writing the config", "the config is unchanged"), lock:
            backend.remove_stale_puts(CONFIG_NAME)
            backend.replace(CONFIG_NAME, data)
        # The new config is in effect from the rename on; a failure to make the
        # rename durable is told as such, not as a refusal (docs/DESIGN.md, "Exact outcomes").
        try:
            backend.sync("")
        except (OSError, StorageError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            warnings.warn(
                DurabilityWarning(
                    f"the new config is in place, but the disk did not confirm it ({why}): "
                    "a crash now may bring back the old one"
                ),
                stacklevel=2,
            )

    @classmethod
    def load(cls, source: Backend | str | os.PathLike[str]) -> RepoConfig:
        """Read and check the config of a Backend or a ``.ckvc`` directory."""
        backend = backend_at(source)
        where = Path(source) / CONFIG_NAME if not isinstance(source, Backend) else CONFIG_NAME
        try:
            data = backend.get(CONFIG_NAME)
            if data is None:
                raise FileNotFoundError(2, "No such file or directory", str(where))
        except (OSError, StorageError) as exc:
            raise UnsupportedFormatError(f"cannot read {where}: {exc}") from None
        return cls.parse(data, where)

    @classmethod
    def load_if_present(cls, backend: Backend) -> RepoConfig | None:
        """The config of a remote's ``backend``, or None when it has none (a remote
        exists when its config does: one request, where checking first takes two).
        A storage error (403, the network) is raised as it is, not as a format error."""
        data = backend.get(CONFIG_NAME)
        return None if data is None else cls.parse(data, CONFIG_NAME)

    @classmethod
    def parse(cls, data: bytes, where: str | os.PathLike[str] = CONFIG_NAME) -> RepoConfig:
        """The config in ``data`` (the bytes of ``where``), checked."""
        try:
            raw = json.loads(data.decode("utf-8"))
        except ValueError as exc:
            raise UnsupportedFormatError(f"cannot read {where}: {exc}") from None
        version = raw.get("format_version") if isinstance(raw, dict) else None
        if version not in READABLE_VERSIONS:
            newest = READABLE_VERSIONS[-1]
            raise UnsupportedFormatError(
                f"repository format version {version!r} is not supported (this ckvc reads up to {newest})"
            )
        if raw.get("hash") != HASH_NAME:
            raise UnsupportedFormatError(f"hash {raw.get('hash')!r} is not supported")
        known = set(cls.__dataclass_fields__)
        try:
            return cls(**{k: v for k, v in raw.items() if k in known}).validate()
        except (TypeError, ValueError) as exc:
            raise InvalidConfigError(f"bad config {where}: {exc}") from None


_NUMBER = (int, float)
_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "format_version": (int,),
    "repo_id": (str,),
    "hash": (str,),
    "chunk_size": (int,),
    "codec": (dict,),
    "max_pack_size": (int,),
    "default_branch": (str,),
    "reflog_expiry_s": _NUMBER,
    "gc_grace_s": _NUMBER,
    "repack_threshold": _NUMBER,
    "retention": (dict, type(None)),
    "keyframe_interval": (int,),
}


def _validate_codec(codec: dict[str, Any]) -> None:
    name, level = codec.get("name"), codec.get("level")
    if not isinstance(name, str):
        raise ValueError(f"codec.name must be a string, got {name!r}")
    if level is not None:
        if isinstance(level, bool) or not isinstance(level, int):
            raise ValueError(f"codec.level must be an integer, got {level!r}")
        if name == "raw":
            raise ValueError("the raw codec takes no level")
        if not MIN_CODEC_LEVEL <= level <= MAX_CODEC_LEVEL:
            raise ValueError(f"codec.level must be between {MIN_CODEC_LEVEL} and {MAX_CODEC_LEVEL}, got {level}")
    if name not in ENCODER_NAMES:  # checked without loading the codecs (and numpy)
        raise ValueError(f"codec: unknown codec {name!r}; known: {sorted(ENCODER_NAMES)}")
