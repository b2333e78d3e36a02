"""Writing records of one store into new packs on a backend, as they are (no
decode and re-encode on the way: the bytes pushed are the bytes stored), each
first verified by the record engine (ckvc.storage.records) so that damage on
this side is never sent.

- :func:`upload_packs` writes records into new packs on a backend, packs in
  parallel, returning what each pack holds;
- :func:`split_groups` cuts located records into groups of at most a pack's size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ckvc.errors import CorruptObjectError, ObjectNotFoundError
from ckvc.executor import Executor
from ckvc.storage.backend import Backend, BackendError
from ckvc.storage.object_store import ObjectStore
from ckvc.storage.packs import PACK_DIR, PackWriter, RecordInfo, pack_key, toc_copy_name
from ckvc.storage.records import Located, Record, Verifier, records_in


@dataclass
class UploadedPack:
    name: str
    entries: list[RecordInfo]
    size: int  # bytes of the pack: header, records, TOC, footer
    copy_size: int = 0  # bytes of its TOC copy


# A pack bigger than its sink's replay limit cannot repeat a failed start or end of
# its multipart upload (its parts have left); its records are still here, so the
# whole pack is written again, under a new name, on a transient failure.
PACK_ATTEMPTS = 3


def upload_packs(
    source: ObjectStore,
    target: Backend,
    groups: list[list[Located]],
    executor: Executor,
    on_pack: Callable[[UploadedPack], None],
    verifier: Verifier | None = None,
) -> None:
    """Write each group as one new pack on ``target`` (its records copied from
    ``source`` as they are), the packs in parallel; ``on_pack`` is called on this
    thread as each is published. ``verifier``: each record is first decoded and
    checked against its id (its delta base from ``source``), so that damage on
    this side is never sent (CorruptObjectError naming the local pack). A failure
    aborts the packs not yet published (a published pack holds only whole records
    and is harmless: the next push finds it in the catalog and does not send it again)."""

    def write(group: list[Located]) -> UploadedPack:
        for attempt in range(1, PACK_ATTEMPTS + 1):
            pack = PackWriter(target)
            try:
                for item, record in records_in(source, group, lambda key: f"local {key}"):
                    if verifier is not None:
                        _verify_outgoing(verifier, item, record)
                    pack.append(item.oid, record.kind, record.codec, record.raw_size, record.payload, record.base)
                pack.seal()
                break
            except BackendError as exc:
                pack.abort()
                if not exc.transient or attempt == PACK_ATTEMPTS:
                    raise
            except BaseException:
                pack.abort()
                raise
        # After the pack: a copy never names a pack that is not there (a reader
        # without one reads the pack's own TOC, so a push killed here loses nothing).
        target.put(pack_key(toc_copy_name(pack.name)), pack.tail)
        return UploadedPack(pack.name, pack.entries, pack.size, len(pack.tail))

    with executor.window(depth=max(1, executor.threads)) as window:
        for group in groups:
            window.submit(write, group, then=on_pack)


def _verify_outgoing(verifier: Verifier, item: Located, record: Record) -> None:
    where = f"local {pack_key(item.entry.pack, PACK_DIR)}"
    try:
        verified = verifier.check(item.oid, record)
    except CorruptObjectError as exc:
        raise CorruptObjectError(
            f"{where}: {exc.reason}; nothing that needs it was sent (ckvc fsck names what is damaged)",
            object_id=item.oid.hex(),
        ) from None
    if verified is None:
        raise ObjectNotFoundError(
            f"{where}: the delta base {(verifier.needs(record) or b'').hex()} of an object is missing",
            object_id=item.oid.hex(),
        )


def split_groups(items: list[Located], max_bytes: int) -> list[list[Located]]:
    """Consecutive items in groups of at most ``max_bytes`` of records (a group
    holds at least one item, whatever its size)."""
    groups: list[list[Located]] = []
    size = 0
    for item in items:
        if not groups or (size + item.entry.record_size > max_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.entry.record_size
    return groups
