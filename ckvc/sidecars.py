"""Small write-once records filed beside the objects they describe: signatures
(ckvc.signing) and notes (ckvc.notes). Each is ``<kind>/<object id>/<name>.json``
on a repository's backend (the local ``.ckvc`` directory or a remote's), created
if absent and never changed, so two writers never conflict and a copy is one put.
push and fetch carry them with :func:`copy` (docs/FORMAT.md sections 21 and 22)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from ckvc.ids import is_full_hex_id
from ckvc.storage.backend import Backend

SUFFIX = ".json"


def canonical_json(data: Mapping[str, Any]) -> bytes:
    """A record's bytes: keys sorted, no spaces, ASCII (FORMAT sections 21 and 22)."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def keys_of(backend: Backend, kind: str, object_id: str) -> list[str]:
    """The record keys filed under one object."""
    return [k for k in backend.list(f"{kind}/{object_id}/") if k.endswith(SUFFIX)]


def by_object(backend: Backend, kind: str) -> dict[str, list[str]]:
    """Object id -> its record keys, from one listing of ``kind/``."""
    out: dict[str, list[str]] = {}
    for key in backend.list(f"{kind}/"):
        parts = key.split("/")
        if len(parts) == 3 and is_full_hex_id(parts[1]) and key.endswith(SUFFIX):
            out.setdefault(parts[1], []).append(key)
    return out


def copy(
    source: Backend,
    target: Backend,
    kind: str,
    wanted: Callable[[str], bool],
    valid: Callable[[str, str, bytes], bool],
    *,
    only: str | None = None,
) -> int:
    """Copy the ``kind`` records ``source`` holds and ``target`` lacks, for the objects
    ``wanted`` accepts (push: those the remote holds; fetch: those now local), or for
    the one object ``only``. A record ``valid(object id, key, bytes)`` refuses is not
    carried. Lists ``target`` only when ``source`` has records; returns how many were
    copied."""
    theirs = {only: keys_of(source, kind, only)} if only is not None else by_object(source, kind)
    if not any(theirs.values()):
        return 0
    mine = {only: keys_of(target, kind, only)} if only is not None else by_object(target, kind)
    copied = 0
    for oid, keys in theirs.items():
        if not wanted(oid):
            continue
        present = set(mine.get(oid, ()))
        for key in keys:
            if key in present or (data := source.get(key)) is None:
                continue
            if valid(oid, key, data) and target.put_if_absent(key, data):
                copied += 1
    return copied
