"""The test vectors of docs/FORMAT.md, parsed out of the document and checked
against the code, so the specification and the implementation cannot drift apart.

Each vector is a fenced block ``vector name=<name> kind=<kind>`` of ``key: value``
lines; a repeated key's values are concatenated. Where cheap, a vector is also
checked by an independent computation (plain blake3, struct, zlib, and a small
stand-alone canonical msgpack encoder) rather than only by ckvc's own code.
"""

from __future__ import annotations

import collections
import json
import re
import struct
import uuid
import warnings
import zlib
from pathlib import Path
from typing import Any

import blake3
import lmdb
import numpy as np
import pytest
import torch
import zstandard

from ckvc.chunking import chunk_count, chunk_spans, size_batches, validate_chunk_size
from ckvc.codecs import decode_chunk, decoder_for, encode_smallest, make_codec
from ckvc.codecs.policy import chunk_size_for
from ckvc.config import RepoConfig
from ckvc.errors import CorruptObjectError, UnsupportedFormatError
from ckvc.ids import ObjectType, object_id
from ckvc.objects import Blob, Commit, Snapshot, Tag
from ckvc.repo import Repo
from ckvc.state import StoredFile, encode_state
from ckvc.storage import packs
from ckvc.storage.index import Index
from ckvc.storage.local import LocalBackend

FORMAT_MD = Path(__file__).resolve().parent.parent / "docs" / "FORMAT.md"

_BLOCK = re.compile(r"^```vector (?P<attrs>[^\n]*)\n(?P<body>.*?)^```\s*$", re.MULTILINE | re.DOTALL)
_LINE = re.compile(r"^(?P<key>[a-z_]+): ?(?P<value>.*)$")


class Vector:
    def __init__(self, name: str, kind: str, fields: dict[str, list[str]]) -> None:
        self.name = name
        self.kind = kind
        self.fields = fields

    def __repr__(self) -> str:
        return f"Vector({self.name})"

    def text(self, key: str) -> str:
        """The value of ``key``, its repeated lines concatenated."""
        return "".join(v.strip() for v in self.fields[key])

    def hex(self, key: str) -> bytes:
        return bytes.fromhex(self.text(key))

    def json(self, key: str) -> Any:
        return json.loads(self.text(key))

    def lines(self, key: str) -> list[str]:
        return [v.strip() for v in self.fields[key]]


def parse_vectors(text: str) -> list[Vector]:
    vectors = []
    for block in _BLOCK.finditer(text):
        attrs = dict(item.split("=", 1) for item in block["attrs"].split())
        fields: dict[str, list[str]] = {}
        for line in block["body"].splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            m = _LINE.match(line)
            assert m is not None, f"vector {attrs.get('name')}: cannot parse line {line!r}"
            fields.setdefault(m["key"], []).append(m["value"])
        vectors.append(Vector(attrs["name"], attrs["kind"], fields))
    return vectors


VECTORS = parse_vectors(FORMAT_MD.read_text(encoding="utf-8"))
KINDS = {
    "layout",
    "config",
    "type-tags",
    "object-id",
    "chunking",
    "codec",
    "codec-fallback",
    "state",
    "snapshot",
    "commit",
    "tag",
    "record-header",
    "pack",
    "index-value",
    "remote-layout",
    "remote-local",
    "prune-log",
}


def of_kind(kind: str) -> list[Any]:
    return [pytest.param(v, id=v.name) for v in VECTORS if v.kind == kind]


def doc_tags() -> dict[str, tuple[int, bytes]]:
    """Type name -> (type byte, tag bytes), as the document's type-tags vector lists them."""
    (vec,) = [v for v in VECTORS if v.kind == "type-tags"]
    out = {}
    for name, values in vec.fields.items():
        byte, tag = values[0].split()
        out[name] = (int(byte), bytes.fromhex(tag))
    return out


# ---- an independent canonical msgpack encoder (FORMAT.md section 9.1) ----------


def mp(value: Any) -> bytes:
    if value is None:
        return b"\xc0"
    if value is True or value is False:
        return b"\xc3" if value else b"\xc2"
    if isinstance(value, int):
        if 0 <= value <= 0x7F:
            return bytes([value])
        if value >= 0:
            for prefix, fmt, limit in ((0xCC, ">B", 1 << 8), (0xCD, ">H", 1 << 16), (0xCE, ">I", 1 << 32)):
                if value < limit:
                    return bytes([prefix]) + struct.pack(fmt, value)
            return b"\xcf" + struct.pack(">Q", value)
        if value >= -32:
            return struct.pack(">b", value)
        for prefix, fmt, limit in ((0xD0, ">b", 1 << 7), (0xD1, ">h", 1 << 15), (0xD2, ">i", 1 << 31)):
            if value >= -limit:
                return bytes([prefix]) + struct.pack(fmt, value)
        return b"\xd3" + struct.pack(">q", value)
    if isinstance(value, float):
        return b"\xcb" + struct.pack(">d", value)
    if isinstance(value, str):
        data = value.encode("utf-8")
        n = len(data)
        if n < 32:
            return bytes([0xA0 | n]) + data
        return _sized(n, (0xD9, 0xDA, 0xDB)) + data
    if isinstance(value, bytes):
        return _sized(len(value), (0xC4, 0xC5, 0xC6)) + value
    if isinstance(value, list):
        head = bytes([0x90 | len(value)]) if len(value) < 16 else _sized(len(value), (None, 0xDC, 0xDD))
        return head + b"".join(mp(v) for v in value)
    if isinstance(value, dict):
        head = bytes([0x80 | len(value)]) if len(value) < 16 else _sized(len(value), (None, 0xDE, 0xDF))
        return head + b"".join(mp(k) + mp(v) for k, v in value.items())
    raise TypeError(type(value))


def _sized(n: int, prefixes: tuple[int | None, int, int]) -> bytes:
    p8, p16, p32 = prefixes
    if p8 is not None and n < 1 << 8:
        return bytes([p8, n])
    if n < 1 << 16:
        return bytes([p16]) + struct.pack(">H", n)
    return bytes([p32]) + struct.pack(">I", n)


# ---- the document itself -------------------------------------------------------


def test_document_has_vectors_of_every_kind() -> None:
    names = [v.name for v in VECTORS]
    assert len(names) == len(set(names)), "vector names must be unique"
    assert {v.kind for v in VECTORS} == KINDS
    assert len(VECTORS) >= 20


def test_independent_msgpack_encoder_sanity() -> None:
    assert mp(-33) == bytes.fromhex("d0df")
    assert mp(65536) == bytes.fromhex("ce00010000")
    assert mp("a" * 32)[:2] == bytes.fromhex("d920")
    assert mp(b"") == bytes.fromhex("c400")


# ---- ids -------------------------------------------------------------------------


@pytest.mark.parametrize("vec", of_kind("type-tags"))
def test_type_tags(vec: Vector) -> None:
    tags = doc_tags()
    assert set(tags) == {t.name.lower() for t in ObjectType}
    for name, (byte, tag) in tags.items():
        kind = ObjectType[name.upper()]
        assert kind.value == byte
        assert kind.tag == tag
        assert tag == b"ckvc-" + name.encode() + b"\x00"  # the rule stated in section 4


@pytest.mark.parametrize("vec", of_kind("object-id"))
def test_object_id(vec: Vector) -> None:
    kind = ObjectType[vec.text("type").upper()]
    data = vec.hex("input")
    expected = vec.text("id")
    assert object_id(kind, data).hex() == expected
    # Independently: BLAKE3-256 over the tag the document lists, then the bytes.
    _, tag = doc_tags()[vec.text("type")]
    assert blake3.blake3(tag + data).hexdigest() == expected


# ---- chunking and codecs --------------------------------------------------------


@pytest.mark.parametrize("vec", of_kind("chunking"))
def test_chunking(vec: Vector) -> None:
    config_size, itemsize, nbytes = (int(vec.text(k)) for k in ("config_chunk_size", "itemsize", "nbytes"))
    expected_size = int(vec.text("chunk_size"))
    expected_spans = [tuple(s) for s in vec.json("spans")]
    validate_chunk_size(config_size)
    # The rule of section 5, computed here, and the writer's own helper.
    assert (config_size - config_size % itemsize if itemsize > 1 else config_size) == expected_size
    assert chunk_size_for(config_size, itemsize) == expected_size
    assert list(chunk_spans(nbytes, expected_size)) == expected_spans
    assert chunk_count(nbytes, expected_size) == len(expected_spans)


def test_chunking_through_a_commit(tmp_path: Path) -> None:
    """chunking-numpy-U3, end to end: a '<U3' array of 9996 bytes in a repo whose
    chunk size is 4096 is stored as 3 chunks of a 4092-byte chunk size."""
    (vec,) = [v for v in VECTORS if v.name == "chunking-numpy-U3"]
    nbytes = int(vec.text("nbytes"))
    with Repo.init(tmp_path, chunk_size=int(vec.text("config_chunk_size"))) as repo:
        arr = np.array(["abc"] * (nbytes // 12))
        assert arr.dtype.str == "<U3" and arr.nbytes == nbytes
        repo.commit({"u": arr})
        (blob,) = repo.read_snapshot(repo.read_commit(repo.resolve("HEAD"))).blobs
        assert (blob.dtype, blob.nbytes, blob.chunk_size) == ("numpy:<U3", nbytes, int(vec.text("chunk_size")))
        assert len(blob.chunks) == len(vec.json("spans"))
        assert np.array_equal(repo.load("HEAD")["u"], arr)


@pytest.mark.parametrize("vec", of_kind("codec"))
def test_codec_decode(vec: Vector) -> None:
    codec = int(vec.text("codec"))
    payload, raw = vec.hex("payload"), vec.hex("raw")
    base = vec.hex("base") if "base" in vec.fields else None
    assert bytes(decode_chunk(codec, payload, len(raw), base)) == raw
    # An independent decoder written from the text of section 6 agrees.
    assert spec_decode(codec, payload, len(raw), base) == raw
    if codec == 1:
        # The frame declares its content size, and decoding is bounded by raw_size.
        assert zstandard.get_frame_parameters(payload).content_size == len(raw)
        assert zstandard.ZstdDecompressor().decompress(payload) == raw
        for wrong in (len(raw) - 1, len(raw) + 1):
            with pytest.raises(CorruptObjectError):
                decoder_for(codec).decode(payload, wrong)
        # A frame without a declared content size is refused.
        unsized = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
        with pytest.raises(CorruptObjectError):
            decoder_for(codec).decode(unsized, len(raw))


def test_unknown_codec_is_refused() -> None:
    for codec in (6, 200):
        with pytest.raises(UnsupportedFormatError):
            decode_chunk(codec, b"", 0)


def _zstd_frame(frame: bytes, size: int) -> bytes:
    assert zstandard.get_frame_parameters(frame).content_size == size
    return zstandard.ZstdDecompressor().decompress(frame)


def _spec_huffman(body: bytes, n: int) -> bytes:
    """Section 6.2.1, bit by bit."""
    values = [s for s in range(256) if body[s >> 3] >> (s & 7) & 1]
    k = len(values)
    nibbles = [(body[32 + j // 2] >> (4 * (j % 2))) & 15 for j in range(k)]
    assert k >= 2 and all(1 <= length <= 11 for length in nibbles)
    assert sum(2 ** (11 - length) for length in nibbles) == 2**11
    codes: dict[tuple[int, int], int] = {}  # (length, code) -> value
    code, previous = 0, 0
    for length, value in sorted(zip(nibbles, values, strict=True)):
        code <<= length - previous
        codes[(length, code)] = value
        code, previous = code + 1, length
    pos = 32 + (k + 1) // 2
    sizes = list(struct.unpack_from("<3I", body, pos))
    pos += 12
    sizes.append(len(body) - pos - sum(sizes))
    q = -(-n // 4)
    out = bytearray()
    for j in range(4):
        stream = body[pos : pos + sizes[j]]
        pos += sizes[j]
        bits = [stream[i // 8] >> (i % 8) & 1 for i in range(8 * len(stream))]
        at = 0
        for _ in range(min(j * q, n), min((j + 1) * q, n)):
            code, length = 0, 0
            while (length, code) not in codes:
                code, length = code << 1 | bits[at], length + 1
                at += 1
                assert length <= 11
            out.append(codes[(length, code)])
    return bytes(out)


def _spec_planes(payload: bytes, raw_size: int) -> bytes:
    """Section 6.2, with plain Python loops."""
    width, flags = payload[0], payload[1]
    n = raw_size // width
    pos, planes = 2 + 5 * width, []
    for k in range(width):
        plane_codec, size = struct.unpack_from("<BI", payload, 2 + 5 * k)
        body = payload[pos : pos + size]
        pos += size
        if plane_codec == 2:
            planes.append(bytearray(_spec_huffman(body, n)))
        else:
            planes.append(bytearray(body if plane_codec == 0 else _zstd_frame(body, n)))
    if flags & 1:
        for i in range(n):
            hi, nxt = planes[width - 1][i], planes[width - 2][i]
            planes[width - 1][i] = (hi & 0x7F) | (nxt & 0x80)
            planes[width - 2][i] = (nxt & 0x7F) | (hi & 0x80)
    out = bytearray(raw_size)
    for i in range(n):
        for k in range(width):
            out[i * width + k] = planes[k][i]
    out[n * width :] = payload[pos:]
    return bytes(out)


def _spec_scaled(base: bytes, n: int, scale: np.float32) -> bytes:
    """Section 6.3's prediction, one binary32 element at a time."""
    assert np.isfinite(scale) and scale >= np.finfo(np.float32).tiny
    normal = np.finfo(np.float32).tiny
    out = bytearray(base)
    for i in range(n):
        b = np.frombuffer(base[4 * i : 4 * i + 4], dtype="<f4")[0]
        with np.errstate(all="ignore"):
            p = np.float32(b * scale)
        if np.isfinite(b) and abs(b) >= normal and np.isfinite(p) and abs(p) >= normal:
            out[4 * i : 4 * i + 4] = np.float32(p).astype("<f4").tobytes()
    return bytes(out)


def spec_decode(codec: int, payload: bytes, raw_size: int, base: bytes | None) -> bytes:
    if codec in (0, 1):
        return payload if codec == 0 else _zstd_frame(payload, raw_size)
    if codec == 2:
        return _spec_planes(payload, raw_size)
    if codec == 3:
        assert base is not None
        transform, width, _depth, _age, inner = payload[:5]
        start = 9 if transform == 3 else 5
        residual = spec_decode(inner, payload[start:], raw_size, None)
        n = raw_size // width if transform in (2, 3) else 0
        out = bytearray(a ^ b for a, b in zip(residual, base, strict=True))  # xor, and the tail of sub
        if transform == 3:
            base = _spec_scaled(base, n, np.frombuffer(payload[5:9], dtype="<f4")[0])
        bits = 8 * width
        for i in range(n):
            z = int.from_bytes(residual[i * width : (i + 1) * width], "little")
            diff = (z >> 1) ^ -(z & 1)
            old = int.from_bytes(base[i * width : (i + 1) * width], "little")
            out[i * width : (i + 1) * width] = ((old + diff) % (1 << bits)).to_bytes(width, "little")
        return bytes(out)
    if codec == 4:
        width, _flags, n, nnz, mask_size, values_size = struct.unpack_from("<BBQQII", payload)
        pos = struct.calcsize("<BBQQII")
        mask = _zstd_frame(payload[pos : pos + mask_size], (n + 7) // 8)
        values_payload = payload[pos + mask_size : pos + mask_size + values_size]
        values = _spec_planes(values_payload, nnz * width) if width > 1 else values_payload
        out, taken = bytearray(), 0
        for i in range(n):
            if mask[i // 8] >> (i % 8) & 1:
                out += values[taken * width : (taken + 1) * width]
                taken += 1
            else:
                out += bytes(width)
        assert taken == nnz
        return bytes(out + payload[pos + mask_size + values_size :])
    if codec == 5:
        scheme, bits, dtype, flags, _age, block, n = struct.unpack_from("<BBBBBIQ", payload)
        assert dtype == 1  # the vectors are float32
        pos = struct.calcsize("<BBBBBIQ")
        blocks = 0 if scheme == 3 else -(-n // block)
        scales = np.frombuffer(payload[pos : pos + 4 * blocks], dtype="<f4")
        codes_codec, size = struct.unpack_from("<BI", payload, pos + 4 * blocks)
        body = payload[pos + 4 * blocks + 5 :]
        assert len(body) == size
        if codes_codec == 2:
            packed = _spec_huffman(body, n)
        else:
            packed = body if codes_codec == 0 else _zstd_frame(body, n if bits == 8 else (n + 1) // 2)
        if scheme == 3:
            exponents = list(packed[:n])
            if flags & 1:
                assert base is not None
                base_bits = struct.unpack(f"<{n}I", base)
                assert all(b & 0x807FFFFF == 0 for b in base_bits)
                exponents = [(b >> 23) + code - 128 for b, code in zip(base_bits, exponents, strict=True)]
            assert all(0 <= e <= 254 for e in exponents)
            return struct.pack(f"<{n}I", *(e << 23 for e in exponents))
        if bits == 8:
            codes = list(packed[:n])
        else:
            codes = [(packed[i // 2] >> (4 * (i % 2))) & 0xF for i in range(n)]
        q = (1 << (bits - 1)) - 1
        reconstructed: list[np.float32] = []
        for i, code in enumerate(codes):
            scale = scales[i // block]
            if scheme == 1:
                value = np.float32(code - q) * scale
            else:
                root = np.float32(max(code, 0.5)) * scale
                value = root * root
            reconstructed.append(np.float32(value))
        result = np.array(reconstructed, dtype=np.float32)
        if flags & 1:
            assert base is not None
            result = result + np.frombuffer(base, dtype="<f4")
        return result.astype("<f4").tobytes()
    raise AssertionError(codec)


@pytest.mark.parametrize("vec", of_kind("codec-fallback"))
def test_codec_raw_fallback(vec: Vector) -> None:
    codec_id, payload = encode_smallest(make_codec(vec.text("codec")), vec.hex("input"))
    assert codec_id == int(vec.text("stored_codec"))
    assert bytes(payload) == vec.hex("payload")


# ---- the state tree and metadata objects ----------------------------------------


@pytest.mark.parametrize("vec", of_kind("state"))
def test_state_tree(vec: Vector) -> None:
    namespace = {"torch": torch, "np": np, "OrderedDict": collections.OrderedDict, "StoredFile": StoredFile}
    state = eval(vec.text("state"), namespace)  # the document's own example expression
    allow_pickle = vec.fields.get("allow_pickle", ["false"])[0].strip() == "true"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree, blobs, pickled, _ = encode_state(state, allow_pickle=allow_pickle)
    assert tree.hex() == vec.text("tree")
    assert str(pickled).lower() == vec.text("pickled")
    got = [{"path": b.path, "dtype": b.dtype, "itemsize": b.itemsize, "data": bytes(b.data).hex()} for b in blobs]
    assert got == vec.json("blobs")


def _blob_from_json(entry: dict[str, Any]) -> Blob:
    chunks = tuple(bytes.fromhex(c) for c in entry["chunks"])
    return Blob(entry["path"], entry["dtype"], entry["nbytes"], entry["chunk_size"], chunks)


@pytest.mark.parametrize("vec", of_kind("snapshot"))
def test_snapshot(vec: Vector) -> None:
    blobs = tuple(_blob_from_json(b) for b in vec.json("blobs"))
    tree = vec.hex("tree")
    encoded = Snapshot(blobs, tree).encode()
    assert encoded.hex() == vec.text("encoded")
    assert object_id(ObjectType.SNAPSHOT, encoded).hex() == vec.text("id")
    wire = [[b.path, b.dtype, b.nbytes, b.chunk_size, b"".join(b.chunks)] for b in blobs]
    assert mp({"v": 1, "blobs": wire, "tree": tree}) == encoded
    assert Snapshot.decode(encoded) == Snapshot(blobs, tree)


def _commit_from_json(f: dict[str, Any]) -> Commit:
    return Commit(
        tree=f["tree"],
        parents=tuple(f["parents"]),
        author=f["author"],
        time_ns=f["time_ns"],
        message=f["message"],
        metrics=f["metrics"],
        metadata=f["metadata"],
        pickled=f["pickled"],
    )


@pytest.mark.parametrize("vec", of_kind("commit"))
def test_commit(vec: Vector) -> None:
    f = vec.json("fields")
    commit = _commit_from_json(f)
    encoded = commit.encode()
    assert encoded.hex() == vec.text("encoded")
    oid = object_id(ObjectType.COMMIT, encoded).hex()
    assert oid == vec.text("id")
    independent = {
        "v": 1,
        "tree": bytes.fromhex(f["tree"]),
        "parents": [bytes.fromhex(p) for p in f["parents"]],
        "author": f["author"],
        "time": f["time_ns"],
        "message": f["message"],
        "metrics": {k: float(v) for k, v in f["metrics"].items()},
        "metadata": f["metadata"],
        "pickled": f["pickled"],
    }
    assert mp(independent) == encoded
    decoded = Commit.decode(encoded, oid)
    assert decoded.tree == f["tree"] and list(decoded.parents) == f["parents"]
    assert (decoded.author, decoded.time_ns, decoded.message) == (f["author"], f["time_ns"], f["message"])
    assert (dict(decoded.metrics), dict(decoded.metadata), decoded.pickled) == (
        f["metrics"],
        f["metadata"],
        f["pickled"],
    )


@pytest.mark.parametrize("vec", of_kind("tag"))
def test_tag(vec: Vector) -> None:
    f = vec.json("fields")
    tag = Tag(f["object"], f["name"], f["tagger"], f["time_ns"], f["message"])
    encoded = tag.encode()
    assert encoded.hex() == vec.text("encoded")
    oid = object_id(ObjectType.TAG, encoded).hex()
    assert oid == vec.text("id")
    independent = {
        "v": 1,
        "object": bytes.fromhex(f["object"]),
        "name": f["name"],
        "tagger": f["tagger"],
        "time": f["time_ns"],
        "message": f["message"],
    }
    assert mp(independent) == encoded
    assert Tag.decode(encoded, oid) == Tag(f["object"], f["name"], f["tagger"], f["time_ns"], f["message"], id=oid)


def test_worked_example_is_one_chain() -> None:
    """Section 14.5: the vectors link up (blob bytes -> chunk -> snapshot -> commit -> tag)."""
    by_name = {v.name: v for v in VECTORS}
    (blob,) = by_name["state-basic"].json("blobs")
    assert by_name["id-chunk-w"].text("input") == blob["data"]
    (entry,) = by_name["snapshot-basic"].json("blobs")
    assert entry["chunks"] == [by_name["id-chunk-w"].text("id")]
    assert by_name["snapshot-basic"].text("tree") == by_name["state-basic"].text("tree")
    root, child = by_name["commit-root"], by_name["commit-child"]
    assert root.json("fields")["tree"] == by_name["snapshot-basic"].text("id")
    assert child.json("fields")["parents"] == [root.text("id")]
    assert by_name["tag-v1"].json("fields")["object"] == root.text("id")


# ---- packs and the index ----------------------------------------------------------


@pytest.mark.parametrize("vec", of_kind("record-header"))
def test_record_header(vec: Vector) -> None:
    f = vec.json("fields")
    oid = bytes.fromhex(f["id"])
    base = bytes.fromhex(f["base"]) if f["base"] else None
    header = packs.encode_record_header(oid, f["type"], f["codec"], f["raw_size"], f["payload_size"], base)
    assert header.hex() == vec.text("header")
    assert len(header) == 92
    # Independently, from the table in section 7.2.
    fixed = struct.pack(
        "<4sBBHQQ32s32s", b"CKR1", f["type"], f["codec"], 0, f["raw_size"], f["payload_size"], oid, base or bytes(32)
    )
    assert fixed + struct.pack("<I", zlib.crc32(fixed)) == header
    assert packs.parse_record_header(header) == (
        f["type"],
        f["codec"],
        f["raw_size"],
        f["payload_size"],
        oid,
        base,
    )


def _toc_json(entries: list[packs.RecordInfo]) -> list[dict[str, Any]]:
    return [
        {
            "id": e.oid.hex(),
            "type": e.kind,
            "codec": e.codec,
            "offset": e.offset,
            "record_size": e.record_size,
            "raw_size": e.raw_size,
        }
        for e in entries
    ]


@pytest.mark.parametrize("vec", of_kind("pack"))
def test_pack(vec: Vector, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = vec.hex("pack")
    records = vec.json("records")
    entries = vec.json("entries")

    # The writer reproduces the document's bytes exactly, given the same UUID.
    monkeypatch.setattr(packs.uuid, "uuid4", lambda: uuid.UUID(vec.text("uuid")))
    backend = LocalBackend(tmp_path)
    writer = packs.PackWriter(backend, "")
    for r in records:
        payload = bytes.fromhex(r["payload"])
        writer.append(bytes.fromhex(r["id"]), r["type"], r["codec"], r["raw_size"], payload)
    path = tmp_path / writer.seal()
    assert path.name == vec.text("name")
    assert path.read_bytes() == expected
    # The TOC copy (section 18.1.1) a push writes beside a remote pack: the pack's end.
    copy_at = int(vec.text("toc_copy_offset"))
    assert writer.tail == expected[copy_at:]
    parsed_copy = packs.parse_toc_copy(writer.tail)
    assert parsed_copy is not None and parsed_copy[1] == len(expected)
    assert _toc_json(parsed_copy[0]) == entries
    assert not list(tmp_path.glob("*.tmp"))

    # An independent parse, from the tables in section 7.
    magic, version, flags, pack_uuid = struct.unpack_from("<8sII16s", expected, 0)
    assert (magic, version, flags, pack_uuid.hex()) == (b"CKVCPACK", 1, 0, vec.text("uuid"))
    fmagic, toc_offset, count, toc_crc, reserved = struct.unpack_from("<8sQQII", expected, len(expected) - 32)
    assert (fmagic, count, reserved) == (b"CKVCTOC1", len(records), 0)
    toc = expected[toc_offset : len(expected) - 32]
    assert len(toc) == 8 + 60 * count and toc[:8] == b"CKTC\0\0\0\0" and zlib.crc32(toc) == toc_crc
    parsed = []
    for i in range(count):
        oid, kind, codec, res, offset, size, raw_size = struct.unpack_from("<32sBBHQQQ", toc, 8 + 60 * i)
        assert res == 0
        parsed.append(packs.RecordInfo(oid, kind, codec, offset, size, raw_size))
    assert _toc_json(parsed) == entries
    offset = 32
    for r, e in zip(records, entries, strict=True):
        assert e["offset"] == offset
        payload = bytes.fromhex(r["payload"])
        record = expected[offset : offset + e["record_size"]]
        assert record[:4] == b"CKR1" and record[92:] == payload
        assert zlib.crc32(record[:88]) == struct.unpack_from("<I", record, 88)[0]
        assert object_id(ObjectType(r["type"]), payload).hex() == r["id"]  # raw codec: payload is the plain bytes
        offset += e["record_size"]
    assert offset == toc_offset

    # The code's readers: through the TOC, and by scanning (the recovery path).
    got, from_toc = packs.pack_entries(backend, path.name)
    assert from_toc and _toc_json(got) == entries
    assert _toc_json(list(packs.scan_records(backend, path.name))) == entries
    for r, e in zip(records, entries, strict=True):
        rec = packs.parse_record(expected[e["offset"] : e["offset"] + e["record_size"]], e["record_size"])
        got_fields = (rec.oid.hex(), rec.kind, rec.codec, rec.raw_size, rec.base)
        assert got_fields == (r["id"], r["type"], r["codec"], r["raw_size"], None)

    # A damaged TOC still yields every record by scanning.
    damaged = tmp_path / "damaged.pack"
    damaged.write_bytes(expected[:-5] + bytes([expected[-5] ^ 0xFF]) + expected[-4:])
    got, from_toc = packs.pack_entries(backend, damaged.name)
    assert not from_toc and _toc_json(got) == entries

    # An unknown pack version is refused.
    future = tmp_path / "future.pack"
    future.write_bytes(expected[:8] + struct.pack("<I", 2) + expected[12:])
    with pytest.raises(UnsupportedFormatError):
        packs.pack_entries(backend, future.name)


@pytest.mark.parametrize("vec", of_kind("index-value"))
def test_index_value(vec: Vector, tmp_path: Path) -> None:
    f = vec.json("fields")
    expected = vec.hex("value")
    independent = struct.pack(
        "<IQQBBQ", f["pack_number"], f["offset"], f["record_size"], f["type"], f["codec"], f["raw_size"]
    )
    assert independent == expected and len(expected) == 30

    # The index stores exactly that value, and the pack maps of section 8.
    oid = bytes(range(32))
    name = "pack-00112233445566778899aabbccddeeff.pack"
    index = Index(tmp_path / "index")
    try:
        assert f["pack_number"] == 0  # the first pack registered in an empty index
        info = packs.RecordInfo(oid, f["type"], f["codec"], f["offset"], f["record_size"], f["raw_size"])
        index.add_pack(name, [info])
    finally:
        index.close()
    env = lmdb.open(str(tmp_path / "index"), max_dbs=4, readonly=True, lock=False)
    try:
        dbs = {n: env.open_db(n.encode(), create=False) for n in ("objects", "packs", "packnames", "meta")}
        with env.begin() as txn:
            assert txn.get(oid, db=dbs["objects"]) == expected
            assert txn.get(name.encode(), db=dbs["packs"]) == struct.pack("<I", 0)
            assert txn.get(struct.pack("<I", 0), db=dbs["packnames"]) == name.encode()
            assert txn.get(b"next_pack", db=dbs["meta"]) == struct.pack("<I", 1)
    finally:
        env.close()


# ---- config and layout -------------------------------------------------------------


@pytest.mark.parametrize("vec", of_kind("config"))
def test_config(vec: Vector, tmp_path: Path) -> None:
    expected = vec.json("json")
    RepoConfig(repo_id=expected["repo_id"]).save(tmp_path)
    written = (tmp_path / "config.json").read_bytes()
    assert written == (json.dumps(expected, indent=2, sort_keys=True) + "\n").encode()
    assert RepoConfig.load(tmp_path) == RepoConfig(repo_id=expected["repo_id"])

    # The version rule: anything but the known versions (and hash) is refused;
    # version 1 is read, but cannot name a codec that version 1 readers lack.
    v1 = {**expected, "format_version": 1, "codec": {"name": "zstd", "level": 1}}
    (tmp_path / "config.json").write_text(json.dumps(v1))
    assert RepoConfig.load(tmp_path).format_version == 1
    bad = (
        {"format_version": 6}, {"format_version": "3"}, {"format_version": None}, {"hash": "sha256"},
        {"format_version": 1}, {"keyframe_interval": 0}, {"codec": {"name": "zipnn"}},
    )  # fmt: skip
    for change in bad:
        (tmp_path / "config.json").write_text(json.dumps({**expected, **change}))
        with pytest.raises(UnsupportedFormatError):
            RepoConfig.load(tmp_path)
    missing = {k: v for k, v in expected.items() if k != "format_version"}
    (tmp_path / "config.json").write_text(json.dumps(missing))
    with pytest.raises(UnsupportedFormatError):
        RepoConfig.load(tmp_path)


@pytest.mark.parametrize("vec", of_kind("layout"))
def test_layout(vec: Vector, tmp_path: Path) -> None:
    with Repo.init(tmp_path) as repo:
        commit_id = repo.commit({"w": torch.zeros(4)}, message="m")
        tag_id = repo.tag("v1", message="release")
        repo.tag("light")
        repo.branch("dev")
    root = tmp_path / ".ckvc"
    files = sorted(
        re.sub(r"pack-[0-9a-f]{32}\.pack", "pack-<uuid>.pack", p.relative_to(root).as_posix())
        for p in root.rglob("*")
        if p.is_file()
    )
    assert files == sorted(vec.lines("file"))

    # File contents, as sections 2, 7 and 11 describe them.
    assert (root / "HEAD").read_bytes() == b"ref: refs/heads/main\n"
    for ref, value in (("heads/main", commit_id), ("heads/dev", commit_id), ("tags/light", commit_id)):
        assert (root / "refs" / ref).read_bytes() == (value + "\n").encode()
    assert (root / "refs/tags/v1").read_bytes() == (tag_id + "\n").encode()
    assert (root / "refs.lock").read_bytes() == b""
    for pack in (root / "packs").glob("*.pack"):
        assert pack.read_bytes()[16:32].hex() == pack.name[len("pack-") : -len(".pack")]
    line = (root / "logs/refs/heads/main").read_text()
    entry = json.loads(line)
    assert entry == {"message": "commit: m", "new": commit_id, "old": None, "time_ns": entry["time_ns"]}
    assert line == json.dumps(entry, sort_keys=True) + "\n"
    assert json.loads((root / "logs/HEAD").read_text())["new"] == commit_id


def test_size_batches_group_small_chunks_in_order() -> None:
    sizes = [100, 200, 1 << 20, 300, (1 << 20) - 300, 1, 5 << 20]
    batches = list(size_batches(sizes, lambda n: n))
    assert batches == [[100, 200], [1 << 20], [300, (1 << 20) - 300], [1], [5 << 20]]
    assert list(size_batches([], lambda n: n)) == []
    assert list(size_batches([3, 3, 3], lambda n: n, limit=6)) == [[3, 3], [3]]


# ---- remotes (section 18) --------------------------------------------------------


def _pushed_to_memory_remote(root: Path) -> tuple[Repo, str, set[str]]:
    """Section 18.6's steps; the repository, the remote URL, and the local files before the push."""
    from ckvc.remote.location import forget_memory_remote

    url = "memory://vec"
    forget_memory_remote(url)
    repo = Repo.init(root)
    repo.commit({"w": torch.zeros(4)}, message="m")
    repo.tag("v1", message="release")
    before = {p.relative_to(root / ".ckvc").as_posix() for p in (root / ".ckvc").rglob("*") if p.is_file()}
    repo.remotes.add("origin", url)
    repo.push("origin", ["main"], tags=True)
    return repo, url, before


@pytest.mark.parametrize("vec", of_kind("remote-layout"))
def test_remote_layout(vec: Vector, tmp_path: Path) -> None:
    from ckvc.remote.location import forget_memory_remote, open_backend

    repo, url, _ = _pushed_to_memory_remote(tmp_path)
    backend = open_backend(url)
    keys = sorted(
        re.sub(r"/~\d{20}-[0-9a-f]{16}$", "/~<entry>", re.sub(r"pack-[0-9a-f]{32}\.pack", "pack-<uuid>.pack", k))
        for k in backend.list("")
    )
    assert keys == sorted(vec.lines("key"))
    # Each TOC copy is its pack's end (18.1.1).
    for key in backend.list("packs/"):
        if key.endswith(".pack.toc"):
            pack, copy = backend.get(key.removesuffix(".toc")), backend.get(key)
            assert pack is not None and copy is not None and pack.endswith(copy)
            assert packs.parse_toc_copy(copy) is not None
    # Contents as sections 3, 7, 11 and 18.3 describe them.
    assert backend.get("HEAD") == b"ref: refs/heads/main\n"
    assert backend.get("refs/heads/main") == f"{repo.head()[1]}\n".encode()
    assert backend.get("refs/tags/v1") == f"{repo.refs.read('refs/tags/v1')}\n".encode()
    remote_config = RepoConfig.load(backend)
    assert remote_config.repo_id != repo.config.repo_id
    assert {**vars(remote_config), "repo_id": None} == {**vars(repo.config), "repo_id": None}
    for key in backend.list("logs/"):
        entry = json.loads(backend.get(key) or b"")
        assert entry["message"] == f"push: from {repo.config.repo_id}" and entry["old"] is None
    for key in backend.list("packs/"):
        if key.endswith(".pack"):
            assert packs.read_toc(backend, key) is not None
    repo.close()
    forget_memory_remote(url)


@pytest.mark.parametrize("vec", of_kind("remote-local"))
def test_remote_local_files(vec: Vector, tmp_path: Path) -> None:
    from ckvc.remote.location import forget_memory_remote

    repo, url, before = _pushed_to_memory_remote(tmp_path)
    root = tmp_path / ".ckvc"
    after = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert sorted(after - before) == sorted(vec.lines("file")) and before <= after
    written = (root / "remotes.json").read_bytes()
    assert written == (json.dumps(vec.json("json"), indent=2, sort_keys=True) + "\n").encode()
    assert (root / "refs/remotes/origin/main").read_bytes() == f"{repo.head()[1]}\n".encode()
    catalog = Index(root / "remotes/origin/catalog")
    try:
        assert catalog.count() == 4  # chunk, snapshot, commit, tag
    finally:
        catalog.close()
    repo.close()
    forget_memory_remote(url)


@pytest.mark.parametrize("vec", of_kind("prune-log"))
def test_prune_log(vec: Vector, tmp_path: Path) -> None:
    from ckvc.pruned import PruneLog, hollow_snapshots

    (tmp_path / "pruned.jsonl").write_text("".join(line + "\n" for line in vec.lines("line")), encoding="utf-8")
    damaged: list[str] = []
    records = PruneLog(tmp_path).records(damaged=damaged)
    expected = {}
    for line in vec.lines("effective"):
        commit, rest = line.split(" ", 1)
        policy, snapshot = rest.rsplit(" ", 1)
        expected[commit] = (policy, snapshot)
    assert {c: (r.policy, r.remote_retention) for c, r in records.items()} == expected
    assert hollow_snapshots(records) == {bytes.fromhex(x) for _, x in expected.values()}
    assert damaged == [f"pruned.jsonl line {n}: not a prune record" for n in vec.lines("damaged")]
    # the writer's bytes: sorted keys, the field only where set, and only for a commit
    # that has no remote_retention record yet
    log = PruneLog(tmp_path / "fresh")
    (tmp_path / "fresh").mkdir()
    assert log.add(["a" * 64], "keep-last 3") == 1
    snapshots = {"a" * 64: "1" * 64, "b" * 64: "2" * 64}
    assert log.add(["a" * 64, "b" * 64], "keep-last 2", snapshots=snapshots) == 2
    assert log.add(["a" * 64], "keep-last 1", snapshots=snapshots) == 0
    assert log.records()["a" * 64].remote_retention == "1" * 64
    written = [json.loads(x) for x in (tmp_path / "fresh" / "pruned.jsonl").read_text().splitlines()]
    assert [list(d) for d in written] == [
        ["commit", "policy", "time_ns"], ["commit", "policy", "remote_retention", "time_ns"],
        ["commit", "policy", "remote_retention", "time_ns"],
    ]  # fmt: skip
    for d, raw in zip(written, (tmp_path / "fresh" / "pruned.jsonl").read_text().splitlines(), strict=True):
        assert raw == json.dumps(d, sort_keys=True)
