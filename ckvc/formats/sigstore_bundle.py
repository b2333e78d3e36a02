"""OpenSSF model-signing bundles (``model.sig``) for exported files.

The format is the one the reference tool (``model_signing``, PyPI) writes with
``model_signing sign key`` and checks with ``model_signing verify key``: a
Sigstore bundle (v0.3 JSON) whose DSSE envelope carries an in-toto statement.
Its predicate lists every file (relative POSIX name, SHA-256 of its bytes), in
name order; the subject is the model's name with the SHA-256 of those digests
concatenated; the envelope is signed with an ECDSA key over DSSE's
pre-authentication encoding (PAE). The tool's key method takes ECDSA P-256/384/521
keys only, so a ckvc export signs with a P-256 key.

ckvc hashes the bytes while it writes them (on a second thread, so hashing
overlaps the writes; no file is read back), unlike the reference tool, which
re-reads the folder. :func:`verify_folder` is ``ckvc verify-export``: the same
checks as ``model_signing verify key``.
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckvc.errors import InvalidInputError, SignatureError

if TYPE_CHECKING:
    from ckvc.signing import PublicKey, SigningKey

SIGNATURE_NAME = "model.sig"
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
# What the reference tool leaves out of a folder by default (and the bundle itself).
IGNORED = (".git", ".gitattributes", ".github", ".gitignore")
HASH_PIECE = 16 << 20  # hashlib releases the GIL on large updates; pieces keep the queue's memory flat


class DigestingWriter:
    """A binary file wrapper whose writes are also hashed (SHA-256), on the digests'
    hashing thread, in order. The written buffers must not change until
    :meth:`Digests.result` returns (export writes views of loaded, immutable state)."""

    def __init__(self, inner: Any, digests: Digests, name: str) -> None:
        self.inner, self.digests, self.name = inner, digests, name
        digests.hashers[name] = hashlib.sha256()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        written = self.inner.write(view)
        for start in range(0, len(view), HASH_PIECE):
            self.digests.queue(self.name, view[start : start + HASH_PIECE])
        return int(written) if written is not None else len(view)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Digests:
    """SHA-256 of each file an export writes, computed while it writes."""

    def __init__(self) -> None:
        self.hashers: dict[str, Any] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckvc-digest")
        self._pending: list[concurrent.futures.Future[None]] = []

    def queue(self, name: str, view: memoryview) -> None:
        self._pending.append(self._pool.submit(self.hashers[name].update, view))
        if len(self._pending) > 256:  # finished futures need not be kept
            self._pending = [f for f in self._pending if not f.done()]

    def wrap(self, f: Any, name: str) -> DigestingWriter:
        return DigestingWriter(f, self, name)

    def result(self) -> dict[str, str]:
        for future in self._pending:
            future.result()
        self._pool.shutdown()
        return {name: h.hexdigest() for name, h in sorted(self.hashers.items())}

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def pae(payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding of an in-toto payload."""
    return b"DSSEv1 %d %s %d %s" % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(payload), payload)


def statement(model_name: str, digests: Mapping[str, str], ignore_paths: list[str]) -> dict[str, Any]:
    root = hashlib.sha256(b"".join(bytes.fromhex(digests[name]) for name in sorted(digests))).hexdigest()
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": model_name, "digest": {"sha256": root}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "serialization": {
                "method": "files",
                "hash_type": "sha256",
                "allow_symlinks": False,
                "ignore_paths": ignore_paths,
            },
            "resources": [{"name": n, "algorithm": "sha256", "digest": digests[n]} for n in sorted(digests)],
        },
    }


def key_hint(public_pem: bytes) -> str:
    """The bundle's public key identifier, as the reference tool computes it."""
    return hashlib.sha256(public_pem).hexdigest()


def make_bundle(model_name: str, digests: Mapping[str, str], key: SigningKey, *, folder: bool) -> bytes:
    """The bundle for files with ``digests`` (relative name -> SHA-256 hex; "." for a
    single file), signed with ``key`` (ECDSA P-256)."""
    check_key(key.algorithm)
    ignore = [*IGNORED, SIGNATURE_NAME] if folder else list(IGNORED)
    payload = json.dumps(statement(model_name, digests, ignore), sort_keys=True).encode()
    signature = key.sign(pae(payload))
    bundle = {
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": key_hint(key.public.pem())}, "tlogEntries": []},
        "dsseEnvelope": {
            "payload": base64.b64encode(payload).decode(),
            "payloadType": PAYLOAD_TYPE,
            "signatures": [{"sig": base64.b64encode(signature).decode(), "keyid": ""}],
        },
    }
    return (json.dumps(bundle, indent=2) + "\n").encode()


def check_key(algorithm: str) -> None:
    if algorithm != "ecdsa-p256":
        raise InvalidInputError(
            "an OpenSSF model-signing bundle needs an ECDSA P-256 key (the reference verifier's key method "
            "takes no Ed25519): `ckvc keygen --type ecdsa-p256 PATH`"
        )


@dataclass(frozen=True)
class ExportVerification:
    model_name: str
    files: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model_name, "files": self.files, "bytes": self.bytes, "verified": True}


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while piece := f.read(HASH_PIECE):
                h.update(piece)
    except OSError as exc:
        raise InvalidInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    return h.hexdigest()


def verify_folder(path: Path, bundle_path: Path, public: PublicKey) -> ExportVerification:
    """``ckvc verify-export``: the bundle's signature checked with ``public``, then every
    file under ``path`` re-hashed against its list (a changed, missing or extra file
    fails). SignatureError saying what does not match."""
    try:
        bundle = json.loads(bundle_path.read_bytes())
        envelope = bundle["dsseEnvelope"]
        payload = base64.b64decode(envelope["payload"], validate=True)
        signature = base64.b64decode(envelope["signatures"][0]["sig"], validate=True)
        claimed = json.loads(payload)
        resources = claimed["predicate"]["resources"]
        ignore = set(claimed["predicate"]["serialization"].get("ignore_paths", ()))
        expected = {r["name"]: r["digest"] for r in resources}
        subject = claimed["subject"][0]
    except FileNotFoundError:
        raise InvalidInputError(f"no signature bundle at {bundle_path}") from None
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise SignatureError(f"{bundle_path} is not a model-signing bundle: {exc}") from None
    if envelope.get("payloadType") != PAYLOAD_TYPE or claimed.get("predicateType") != PREDICATE_TYPE:
        raise SignatureError(f"{bundle_path}: not an in-toto statement of {PREDICATE_TYPE}")
    if not public.verifies(signature, pae(payload)):
        raise SignatureError(f"{bundle_path}: the signature does not verify with key {public.name}")
    if subject.get("digest", {}).get("sha256") != statement("", expected, [])["subject"][0]["digest"]["sha256"]:
        raise SignatureError(f"{bundle_path}: the subject digest does not match the listed files")
    actual: dict[str, str] = {}
    total = 0
    if path.is_file():
        actual["."] = _hash_file(path)
        total = path.stat().st_size
    else:
        ignored = ignore | {os.path.relpath(bundle_path, path)} if bundle_path.is_relative_to(path) else ignore
        for root, dirs, names in os.walk(path):
            rel_root = os.path.relpath(root, path)
            dirs[:] = [d for d in dirs if os.path.normpath(os.path.join(rel_root, d)) not in ignored]
            for d in dirs:
                if Path(root, d).is_symlink():  # os.walk does not enter it: it would go unchecked
                    raise SignatureError(f"{Path(root, d)} is a symlink; the bundle allows none")
            for name in names:
                rel = os.path.normpath(os.path.join(rel_root, name))
                if rel in ignored:
                    continue
                file = Path(root, name)
                if file.is_symlink():
                    raise SignatureError(f"{file} is a symlink; the bundle allows none")
                actual[Path(rel).as_posix()] = _hash_file(file)
                total += file.stat().st_size
    changed = sorted(n for n in expected.keys() & actual.keys() if expected[n] != actual[n])
    missing = sorted(expected.keys() - actual.keys())
    extra = sorted(actual.keys() - expected.keys())
    for what, names in (("changed", changed), ("missing", missing), ("not signed", extra)):
        if names:
            raise SignatureError(f"{path}: {len(names)} file(s) {what}: {', '.join(names[:5])}")
    return ExportVerification(str(subject.get("name", "")), len(actual), total)
