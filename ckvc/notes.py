"""Notes: what is learned about a commit after it was made (an evaluation's metric,
a validation outcome), git notes for checkpoints.

A note is a write-once record ``notes/<commit id>/<note id>.json`` beside the commit
(ckvc.sidecars), its id the BLAKE3 of its bytes, so adding one changes no commit id,
two writers never conflict, and push, fetch and clone carry them with the history
(docs/FORMAT.md section 22). Notes are appended, never edited: the newest value of a
metric wins, whether it came with the commit or in a note (:func:`metrics_with_notes`),
and ``log --best``, ``rank`` and ``retain --keep-best`` rank by it. A note is signed
(its id, type "note") when signing is configured; under ``require_signatures`` only
notes a trusted key signed count. A record that does not match its name or does not
parse is skipped with a warning (fsck reports it).
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import blake3

from ckvc import sidecars, signing
from ckvc.core import check_utf8, default_author
from ckvc.errors import DamageWarning, InvalidInputError, storage_errors
from ckvc.ids import is_full_hex_id
from ckvc.objects import Commit, validate_metadata, validate_metrics

if TYPE_CHECKING:
    from ckvc.core import Repository

NOTES = "notes"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Note:
    commit: str
    time_ns: int
    author: str
    message: str = ""
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        return (
            sidecars.canonical_json(
                {
                    "author": self.author,
                    "commit": self.commit,
                    "format": FORMAT_VERSION,
                    "message": self.message,
                    "metadata": dict(self.metadata),
                    "metrics": dict(self.metrics),
                    "time_ns": self.time_ns,
                }
            )
            + b"\n"
        )

    @property
    def id(self) -> str:
        return blake3.blake3(self.encode()).hexdigest()

    @property
    def key(self) -> str:
        return f"{NOTES}/{self.commit}/{self.id}.json"

    @classmethod
    def decode(cls, data: bytes) -> Note:
        """ValueError for anything that is not a canonical note record."""
        parsed = json.loads(data)
        expected = {"author", "commit", "format", "message", "metadata", "metrics", "time_ns"}
        if not isinstance(parsed, dict) or set(parsed) != expected or parsed["format"] != FORMAT_VERSION:
            raise ValueError(f"a note record has exactly the keys {sorted(expected)} and format 1")
        time_ns = parsed["time_ns"]
        if isinstance(time_ns, bool) or not isinstance(time_ns, int) or time_ns < 0:
            raise ValueError("time_ns must be a non-negative integer")
        if not is_full_hex_id(parsed["commit"]) or not isinstance(parsed["author"], str):
            raise ValueError("commit must be 64 lowercase hex digits and author a string")
        if not isinstance(parsed["message"], str):
            raise ValueError("message must be a string")
        note = cls(
            commit=parsed["commit"],
            time_ns=time_ns,
            author=parsed["author"],
            message=parsed["message"],
            metrics=validate_metrics(parsed["metrics"]),
            metadata=validate_metadata(parsed["metadata"]),
        )
        if note.encode() != data:
            raise ValueError("not in canonical form")
        return note


def check_record(commit_id: str, key: str, data: bytes) -> Note:
    """The note stored at ``key``, ValueError unless it is exactly the record its name
    says, filed under its own commit."""
    note = Note.decode(data)
    if note.commit != commit_id or note.key != key:
        raise ValueError(f"{key} holds the note {note.id[:12]} of commit {note.commit[:12]}")
    return note


def _carried(oid: str, key: str, data: bytes) -> bool:
    try:
        check_record(oid, key, data)
    except (ValueError, TypeError):
        return False
    return True


def copy_notes(source: Any, target: Any, wanted: Any, *, only: str | None = None) -> int:
    """The note records backend ``source`` holds and ``target`` lacks (ckvc.sidecars.copy)."""
    return sidecars.copy(source, target, NOTES, wanted, _carried, only=only)


# ---- adding and reading ------------------------------------------------------------


def add_note(
    core: Repository,
    commit_id: str,
    *,
    metrics: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    message: str = "",
    sign: bool | None = None,
    time_ns: int | None = None,
) -> Note:
    """Append a note to ``commit_id`` (durable on return), signed with the configured
    key when ``sign`` (default: the ``sign_commits`` setting)."""
    if not isinstance(message, str):
        raise InvalidInputError("a note's message must be a str")
    check_utf8("note message", message)
    try:
        clean_metrics = validate_metrics(metrics)
        clean_metadata = validate_metadata(metadata)
    except ValueError as exc:
        raise InvalidInputError(str(exc)) from None
    if not (clean_metrics or clean_metadata or message):
        raise InvalidInputError("a note needs a metric, metadata or a message")
    signer = signing.signer_for(core, sign)
    core.require_writable("adding a note")
    note = Note(
        commit=commit_id,
        time_ns=time.time_ns() if time_ns is None else time_ns,
        author=default_author(),
        message=message,
        metrics=clean_metrics,
        metadata=clean_metadata,
    )
    with storage_errors("writing a note", "no note was added"):
        if signer is not None:  # the signature first: a note never exists unsigned when it should not
            signing.sign(core, note.id, "note", signer)
        core.refs.backend.put_if_absent(note.key, note.encode())
    return note


def _parse(core: Repository, commit_id: str, keys: Iterable[str], damaged: list[str] | None) -> list[Note]:
    out: list[Note] = []
    bad: list[str] = []
    for key in keys:
        data = core.refs.backend.get(key)
        if data is None:
            continue
        try:
            out.append(check_record(commit_id, key, data))
        except (ValueError, TypeError) as exc:
            bad.append(f"{key}: {exc}")
    if bad:
        if damaged is not None:
            damaged.extend(bad)
        else:
            warnings.warn(DamageWarning(f"skipped {len(bad)} damaged note(s): {bad[0]}"), stacklevel=3)
    return sorted(out, key=lambda n: (n.time_ns, n.id))


def _trusted(core: Repository, notes: list[Note]) -> list[Note]:
    """Under require_signatures, only the notes a trusted key signed."""
    trust = signing.TrustSettings.load(core)
    if not trust.require_signatures or not notes:
        return notes
    keys = trust.keys()
    store = signing.signatures_of(core)
    kept = [n for n in notes if signing.judge(n.id, "note", store.of(n.id), keys).good]
    if len(kept) < len(notes):
        warnings.warn(
            DamageWarning(f"ignored {len(notes) - len(kept)} note(s) no trusted key signed (require_signatures)"),
            stacklevel=3,
        )
    return kept


def notes_of(core: Repository, commit_id: str, *, damaged: list[str] | None = None) -> list[Note]:
    """``commit_id``'s notes, oldest first; damaged records skipped (listed in
    ``damaged`` when given, else a warning)."""
    return _trusted(core, _parse(core, commit_id, sidecars.keys_of(core.refs.backend, NOTES, commit_id), damaged))


def all_notes(core: Repository) -> dict[str, list[Note]]:
    """Every commit's notes, from one listing of ``notes/``."""
    out: dict[str, list[Note]] = {}
    for commit_id, keys in sidecars.by_object(core.refs.backend, NOTES).items():
        found = _trusted(core, _parse(core, commit_id, keys, None))
        if found:
            out[commit_id] = found
    return out


def damaged_notes(core: Repository) -> list[str]:
    """What fsck reports: each note record that is not the record its name says."""
    damaged: list[str] = []
    for commit_id, keys in sidecars.by_object(core.refs.backend, NOTES).items():
        _parse(core, commit_id, keys, damaged)
    return damaged


def metrics_with_notes(commit: Commit, notes: Sequence[Note]) -> dict[str, float]:
    """A commit's metrics as its notes leave them: the commit's own, then each note's
    in time order, a later value replacing an earlier one."""
    out = dict(commit.metrics)
    for note in notes:
        out.update(note.metrics)
    return out


def noted_metrics(core: Repository, commits: Iterable[Commit]) -> dict[str, dict[str, float]]:
    """Commit id -> its metrics with its notes (:func:`metrics_with_notes`), for many
    commits with one listing."""
    notes = all_notes(core)
    return {c.id: metrics_with_notes(c, notes.get(c.id, ())) for c in commits}
