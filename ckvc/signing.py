"""Signatures over object ids: who vouches for a commit (or an annotated tag).

A signature covers an object's id (a commit id covers its snapshot, every chunk
and its parents), its type, the signer's key id and the time, signed with an
Ed25519 or ECDSA P-256 key through ``cryptography``. It lives beside the object,
never inside it, so signing changes no id: ``signatures/<object id>/<sig id>.json``
on the repository's backend (the local ``.ckvc`` directory or a remote's), written
once and never changed (docs/FORMAT.md section 21). push and fetch carry them.

Trust is configuration, never repository data: ``.ckvc/trust.json`` (``ckvc
config sign_key|sign_commits|trusted_keys|require_signatures``), each overridable
by the environment ($CKVC_SIGN_KEY, $CKVC_SIGN_COMMITS, $CKVC_TRUSTED_KEYS,
$CKVC_REQUIRE_SIGNATURES), so a bucket someone else can write cannot change
whom this machine trusts. With ``require_signatures`` every read path refuses a
commit no trusted key signed (:func:`require_signed`) before a tensor byte is read.
"""

from __future__ import annotations

import base64
import json
import os
import stat
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import blake3

from ckvc import sidecars
from ckvc.errors import CkvcWarning, InvalidInputError, SignatureError, storage_errors
from ckvc.ids import is_full_hex_id
from ckvc.storage.backend import Backend
from ckvc.storage.durable import write_atomic

if TYPE_CHECKING:
    from ckvc.core import Repository

SIGNATURES = "signatures"
TRUST_FILE = "trust.json"
FORMAT_VERSION = 1
# What is signed starts with this, so a ckvc signature is never valid as anything else.
DOMAIN = b"ckvc signature v1\n"
ALGORITHMS = ("ed25519", "ecdsa-p256")
ObjectKind = Literal["commit", "tag", "note"]
KINDS = ("commit", "tag", "note")  # a note: its record's id (ckvc.notes)
Status = Literal["good", "bad", "untrusted", "unsigned"]
PUBLIC_SUFFIXES = (".pem", ".pub")


# ---- keys -------------------------------------------------------------------------


def key_id_of(public: Any) -> str:
    """A public key's id: BLAKE3 of its DER SubjectPublicKeyInfo (64 hex)."""
    from cryptography.hazmat.primitives import serialization

    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return blake3.blake3(der).hexdigest()


def _algorithm_of(key: Any, where: str) -> str:
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    if isinstance(key, ed25519.Ed25519PrivateKey | ed25519.Ed25519PublicKey):
        return "ed25519"
    if isinstance(key, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        return "ecdsa-p256"
    raise InvalidInputError(f"{where}: only Ed25519 and ECDSA P-256 keys are supported")


@dataclass(frozen=True)
class PublicKey:
    name: str
    algorithm: str
    key_id: str
    key: Any = field(repr=False, compare=False)

    def verifies(self, signature: bytes, message: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        try:
            if self.algorithm == "ed25519":
                self.key.verify(signature, message)
            else:
                self.key.verify(signature, message, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature:
            return False
        return True

    def pem(self) -> bytes:
        from cryptography.hazmat.primitives import serialization

        return bytes(self.key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


@dataclass(frozen=True)
class SigningKey:
    path: Path
    algorithm: str
    key_id: str
    key: Any = field(repr=False, compare=False)

    @property
    def public(self) -> PublicKey:
        return PublicKey(self.path.stem, self.algorithm, self.key_id, self.key.public_key())

    def sign(self, message: bytes) -> bytes:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        if self.algorithm == "ed25519":
            return bytes(self.key.sign(message))
        return bytes(self.key.sign(message, ec.ECDSA(hashes.SHA256())))


def load_signing_key(path: str | os.PathLike[str]) -> SigningKey:
    """An unencrypted PEM private key (PKCS#8 or the traditional forms)."""
    from cryptography.hazmat.primitives import serialization

    where = Path(path).expanduser()
    try:
        data = where.read_bytes()
    except OSError as exc:
        raise InvalidInputError(f"signing key {where}: {exc.strerror or exc}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise InvalidInputError(f"signing key {where} is encrypted; ckvc reads unencrypted PEM keys") from None
    except ValueError:
        raise InvalidInputError(f"signing key {where} is not a PEM private key") from None
    algorithm = _algorithm_of(key, f"signing key {where}")
    return SigningKey(where, algorithm, key_id_of(key.public_key()), key)


def public_key_from_pem(data: bytes, name: str, where: str) -> PublicKey:
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        raise InvalidInputError(f"{where} is not a PEM public key") from None
    return PublicKey(name, _algorithm_of(key, where), key_id_of(key), key)


def generate_key(path: str | os.PathLike[str], algorithm: str = "ed25519") -> SigningKey:
    """A new key pair: the private key at ``path`` (mode 0600, never overwritten) and
    its public key at ``path`` + ``.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519

    if algorithm not in ALGORITHMS:
        raise InvalidInputError(f"key type must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    where = Path(path).expanduser()
    public_path = where.with_name(where.name + ".pub")
    for target in (where, public_path):
        if target.exists():
            raise InvalidInputError(f"{target} exists; ckvc never overwrites a key")
    key: Any = (
        ed25519.Ed25519PrivateKey.generate() if algorithm == "ed25519" else ec.generate_private_key(ec.SECP256R1())
    )
    private_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    with storage_errors(f"writing {where}", "no key was written"):
        fd = os.open(where, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(fd, "wb") as f:
            f.write(private_pem)
            f.flush()
            os.fsync(f.fileno())
        signing = SigningKey(where, algorithm, key_id_of(key.public_key()), key)
        write_atomic(public_path, signing.public.pem())
    return signing


def trusted_keys(path: str | os.PathLike[str]) -> dict[str, PublicKey]:
    """The keys a trust file or folder names, by key id. A folder: each ``*.pem`` or
    ``*.pub`` file is one PEM public key, named by its file name's stem. A file: one
    PEM public key (named by its stem), or lines ``<name> <base64 DER public key>``
    (``#`` comments), in the spirit of OpenSSH's allowed_signers."""
    where = Path(path).expanduser()
    out: dict[str, PublicKey] = {}
    try:
        if where.is_dir():
            for item in sorted(where.iterdir()):
                if item.suffix in PUBLIC_SUFFIXES and item.is_file():
                    key = public_key_from_pem(item.read_bytes(), item.stem, str(item))
                    out.setdefault(key.key_id, key)
            return out
        data = where.read_bytes()
    except OSError as exc:
        raise InvalidInputError(f"trusted keys {where}: {exc.strerror or exc}") from None
    if b"-----BEGIN" in data:
        key = public_key_from_pem(data, where.stem, str(where))
        return {key.key_id: key}
    from cryptography.hazmat.primitives import serialization

    for number, raw in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, _, encoded = line.partition(" ")
        try:
            public = serialization.load_der_public_key(base64.b64decode(encoded.strip(), validate=True))
        except ValueError:
            raise InvalidInputError(f"trusted keys {where} line {number}: expected '<name> <base64 key>'") from None
        algorithm = _algorithm_of(public, f"trusted keys {where} line {number}")
        key = PublicKey(name, algorithm, key_id_of(public), public)
        out.setdefault(key.key_id, key)
    return out


def allowed_signers_line(key: PublicKey) -> str:
    """``key`` as one line of a trusted-keys file."""
    from cryptography.hazmat.primitives import serialization

    der = key.key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return f"{key.name} {base64.b64encode(der).decode()}"


# ---- signatures -------------------------------------------------------------------


@dataclass(frozen=True)
class Signature:
    """One signature record (FORMAT.md section 21)."""

    object: str
    type: str
    algorithm: str
    key_id: str
    signer: str
    time_ns: int
    signature: bytes = field(repr=False)

    def _fields(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "format": FORMAT_VERSION,
            "key_id": self.key_id,
            "object": self.object,
            "signer": self.signer,
            "time_ns": self.time_ns,
            "type": self.type,
        }

    def message(self) -> bytes:
        """The bytes the key signs: the domain line, then every field but the signature."""
        return DOMAIN + sidecars.canonical_json(self._fields())

    def encode(self) -> bytes:
        return (
            sidecars.canonical_json({**self._fields(), "signature": base64.b64encode(self.signature).decode()}) + b"\n"
        )

    @property
    def id(self) -> str:
        return blake3.blake3(self.encode()).hexdigest()[:32]

    @classmethod
    def decode(cls, data: bytes) -> Signature:
        """ValueError for anything that is not a well-formed record."""
        parsed = json.loads(data)
        if not isinstance(parsed, dict) or parsed.get("format") != FORMAT_VERSION:
            raise ValueError("not a ckvc signature record of format 1")
        expected = {"algorithm", "format", "key_id", "object", "signature", "signer", "time_ns", "type"}
        if set(parsed) != expected:
            raise ValueError(f"signature record keys must be {sorted(expected)}")
        sig = cls(
            object=parsed["object"],
            type=parsed["type"],
            algorithm=parsed["algorithm"],
            key_id=parsed["key_id"],
            signer=parsed["signer"],
            time_ns=parsed["time_ns"],
            signature=base64.b64decode(str(parsed["signature"]), validate=True),
        )
        if not (is_full_hex_id(sig.object) and is_full_hex_id(sig.key_id)):
            raise ValueError("object and key_id must be 64 lowercase hex digits")
        if sig.type not in KINDS or sig.algorithm not in ALGORITHMS or not isinstance(sig.signer, str):
            raise ValueError("bad type, algorithm or signer")
        if isinstance(sig.time_ns, bool) or not isinstance(sig.time_ns, int) or sig.time_ns < 0:
            raise ValueError("time_ns must be a non-negative integer")
        if sig.encode() != data:
            raise ValueError("not in canonical form")
        return sig


def make_signature(key: SigningKey, object_id: str, kind: ObjectKind, *, time_ns: int | None = None) -> Signature:
    unsigned = Signature(
        object=object_id,
        type=kind,
        algorithm=key.algorithm,
        key_id=key.key_id,
        signer=key.path.stem,
        time_ns=time.time_ns() if time_ns is None else time_ns,
        signature=b"",
    )
    return Signature(**{**asdict(unsigned), "signature": key.sign(unsigned.message())})


class SignatureStore:
    """The signature records on one backend, ``signatures/<object>/<sig id>.json``."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @staticmethod
    def key(sig: Signature) -> str:
        return f"{SIGNATURES}/{sig.object}/{sig.id}.json"

    def add(self, sig: Signature) -> bool:
        """Store ``sig`` durably; False if it was there already."""
        return self.backend.put_if_absent(self.key(sig), sig.encode())

    def put_raw(self, key: str, data: bytes) -> bool:
        return self.backend.put_if_absent(key, data)

    def keys(self, object_id: str) -> list[str]:
        return sidecars.keys_of(self.backend, SIGNATURES, object_id)

    def get(self, key: str) -> bytes | None:
        return self.backend.get(key)

    def of(self, object_id: str) -> Iterator[tuple[str, Signature | None]]:
        """(key, record or None where it does not parse) for each record filed under ``object_id``."""
        for key in self.keys(object_id):
            data = self.get(key)
            if data is None:
                continue
            try:
                yield key, Signature.decode(data)
            except (ValueError, TypeError):
                yield key, None


def signatures_of(core: Repository) -> SignatureStore:
    return SignatureStore(core.refs.backend)


def _carried(oid: str, key: str, data: bytes) -> bool:
    """A record push and fetch carry: it parses and is filed under its own object and name."""
    try:
        sig = Signature.decode(data)
    except (ValueError, TypeError):
        return False
    return sig.object == oid and SignatureStore.key(sig) == key


def copy_signatures(
    source: SignatureStore, target: SignatureStore, wanted: Callable[[str], bool], *, only: str | None = None
) -> int:
    """The signature records ``source`` holds and ``target`` lacks (ckvc.sidecars.copy)."""
    return sidecars.copy(source.backend, target.backend, SIGNATURES, wanted, _carried, only=only)


# ---- trust settings ---------------------------------------------------------------


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(value: str, what: str) -> bool:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise InvalidInputError(f"{what} must be true or false, got {value!r}")


@dataclass
class TrustSettings:
    """``.ckvc/trust.json``; the environment overrides each field (:meth:`load`)."""

    sign_key: str | None = None
    sign_commits: bool = False
    trusted_keys: str | None = None
    require_signatures: bool = False

    @classmethod
    def stored(cls, repo_dir: Path | None) -> TrustSettings:
        if repo_dir is None:
            return cls()
        where = repo_dir / TRUST_FILE
        try:
            data = json.loads(where.read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            raise InvalidInputError(f"{where} is not readable JSON: {exc}") from None
        if not isinstance(data, dict) or set(data) - set(cls.__dataclass_fields__):
            raise InvalidInputError(f"{where}: expected keys {', '.join(cls.__dataclass_fields__)}")
        settings = cls(**data)
        for name in ("sign_commits", "require_signatures"):
            if not isinstance(getattr(settings, name), bool):
                raise InvalidInputError(f"{where}: {name} must be true or false")
        for name in ("sign_key", "trusted_keys"):
            if getattr(settings, name) is not None and not isinstance(getattr(settings, name), str):
                raise InvalidInputError(f"{where}: {name} must be a path")
        return settings

    @classmethod
    def load(cls, core: Repository) -> TrustSettings:
        settings = cls.stored(core.dir)
        env = os.environ
        if env.get("CKVC_SIGN_KEY"):
            settings.sign_key = env["CKVC_SIGN_KEY"]
        if env.get("CKVC_TRUSTED_KEYS"):
            settings.trusted_keys = env["CKVC_TRUSTED_KEYS"]
        if env.get("CKVC_SIGN_COMMITS"):
            settings.sign_commits = parse_bool(env["CKVC_SIGN_COMMITS"], "$CKVC_SIGN_COMMITS")
        if env.get("CKVC_REQUIRE_SIGNATURES"):
            settings.require_signatures = parse_bool(env["CKVC_REQUIRE_SIGNATURES"], "$CKVC_REQUIRE_SIGNATURES")
        return settings

    def save(self, repo_dir: Path) -> None:
        write_atomic(repo_dir / TRUST_FILE, (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode())

    def keys(self) -> dict[str, PublicKey]:
        return trusted_keys(self.trusted_keys) if self.trusted_keys else {}


SETTINGS = ("sign_key", "sign_commits", "trusted_keys", "require_signatures")


def set_trust(core: Repository, key: str, value: str) -> TrustSettings:
    """``ckvc config KEY VALUE`` for the four trust settings (checked before saving:
    a key that does not load, a trust file that does not parse)."""
    if core.dir is None:
        raise InvalidInputError("trust settings belong to a local repository")
    settings = TrustSettings.stored(core.dir)
    if key in ("sign_commits", "require_signatures"):
        setattr(settings, key, parse_bool(value, key))
    elif key in ("sign_key", "trusted_keys"):
        path = None if value in ("", "none") else str(Path(value).expanduser().resolve())
        if path is not None:
            if key == "sign_key":
                load_signing_key(path)
            elif not trusted_keys(path):
                raise InvalidInputError(f"{path} holds no public key")
        setattr(settings, key, path)
    else:
        raise InvalidInputError(f"unknown trust setting {key!r}; known: {', '.join(SETTINGS)}")
    if settings.sign_commits and settings.sign_key is None and not os.environ.get("CKVC_SIGN_KEY"):
        raise InvalidInputError("sign_commits needs a key: `ckvc config sign_key PATH` first")
    if settings.require_signatures and settings.trusted_keys is None and not os.environ.get("CKVC_TRUSTED_KEYS"):
        raise InvalidInputError("require_signatures needs trusted keys: `ckvc config trusted_keys PATH` first")
    settings.save(core.dir)
    return settings


def signer_for(core: Repository, sign: bool | None) -> SigningKey | None:
    """The key a commit is signed with: ``sign`` True (a key must be configured),
    False (none), None (the ``sign_commits`` setting)."""
    settings = TrustSettings.load(core)
    if sign is False or (sign is None and not settings.sign_commits):
        return None
    if settings.sign_key is None:
        raise InvalidInputError("no signing key: `ckvc config sign_key PATH` or $CKVC_SIGN_KEY")
    return load_signing_key(settings.sign_key)


# ---- signing and verifying ----------------------------------------------------------


def sign(core: Repository, object_id: str, kind: ObjectKind, key: SigningKey) -> Signature:
    """Sign ``object_id`` and store the record durably in ``core``."""
    sig = make_signature(key, object_id, kind)
    with storage_errors("storing a signature", "the object is not signed"):
        signatures_of(core).add(sig)
    return sig


@dataclass(frozen=True)
class Verification:
    """What the signatures of one object say, against a set of trusted keys."""

    object: str
    type: str
    status: Status
    signer: str | None = None  # the trusted key's name (good, bad), else what the record claims
    key_id: str | None = None
    time_ns: int | None = None
    problems: tuple[str, ...] = ()

    @property
    def good(self) -> bool:
        return self.status == "good"

    def describe(self) -> str:
        what = f"{self.type} {self.object[:12]}"
        if self.status == "good":
            return f"good signature on {what} by {self.signer} (key {self.key_id and self.key_id[:16]})"
        if self.status == "unsigned":
            return f"{what} is not signed"
        if self.status == "untrusted":
            return f"{what} is signed by {self.signer!r} (key {self.key_id and self.key_id[:16]}), not a trusted key"
        return f"{what} has a bad signature: {self.problems[0] if self.problems else 'it does not verify'}"

    def to_json(self) -> dict[str, Any]:
        return {
            "object": self.object,
            "type": self.type,
            "status": self.status,
            "signer": self.signer,
            "key_id": self.key_id,
            "time_ns": self.time_ns,
            "problems": list(self.problems),
        }


def judge(
    object_id: str, kind: str, records: Iterable[tuple[str, Signature | None]], trusted: Mapping[str, PublicKey]
) -> Verification:
    """The verdict on ``object_id`` from its signature records: good when a trusted key's
    signature over this very object and type verifies (junk beside it does not
    spoil it); else bad (a record that fails to verify, names another object, or
    does not parse), untrusted (valid form, unknown key), or unsigned."""
    problems: list[str] = []
    untrusted: Signature | None = None
    for key, sig in records:
        if sig is None:
            problems.append(f"{key} is not a signature record")
            continue
        if sig.object != object_id or sig.type != kind:
            problems.append(f"{key} signs {sig.type} {sig.object[:12]}, not this {kind}")
            continue
        public = trusted.get(sig.key_id)
        if public is None:
            untrusted = untrusted or sig
            continue
        if sig.algorithm != public.algorithm or not public.verifies(sig.signature, sig.message()):
            problems.append(f"the signature claiming key {public.name} ({sig.key_id[:16]}) does not verify")
            continue
        return Verification(object_id, kind, "good", public.name, sig.key_id, sig.time_ns, tuple(problems))
    if problems:
        return Verification(object_id, kind, "bad", problems=tuple(problems))
    if untrusted is not None:
        return Verification(object_id, kind, "untrusted", untrusted.signer, untrusted.key_id, untrusted.time_ns)
    return Verification(object_id, kind, "unsigned")


def verify(
    core: Repository, object_id: str, kind: ObjectKind, trusted: Mapping[str, PublicKey] | None = None
) -> Verification:
    """``object_id``'s signatures in ``core`` against ``trusted`` (default: the
    configured trusted keys)."""
    keys = TrustSettings.load(core).keys() if trusted is None else trusted
    return judge(object_id, kind, signatures_of(core).of(object_id), keys)


def check_ref_targets(
    refs: Mapping[str, str], store: SignatureStore, trusted: Mapping[str, PublicKey], action: str
) -> None:
    """Under ``require_signatures``, before fetch or clone copies anything: each ref's
    target must be signed by a trusted key (a tag's as a tag or as a commit).
    SignatureError naming the first ref that is not."""
    for ref, oid in sorted(refs.items()):
        records = list(store.of(oid))
        kinds: tuple[ObjectKind, ...] = ("tag", "commit") if ref.startswith("refs/tags/") else ("commit",)
        verdicts = [judge(oid, kind, records, trusted) for kind in kinds]
        if not any(v.good for v in verdicts):
            raise SignatureError(f"{ref}: {verdicts[-1].describe()}: {action} refused (require_signatures is set)")


def refuse(verdict: Verification, action: str) -> SignatureError:
    return SignatureError(f"{verdict.describe()}: {action} refused (require_signatures is set)")


def require_signed(core: Repository, commit_id: str, *, verify_signatures: bool | None = None) -> None:
    """The read-path check: with ``require_signatures`` set (or ``verify_signatures``
    True), SignatureError unless a trusted key signed ``commit_id``. An explicit
    ``verify_signatures=False`` skips it, with a warning when the policy is on."""
    settings = TrustSettings.load(core)
    if verify_signatures is False:
        if settings.require_signatures:
            warnings.warn(
                CkvcWarning(f"commit {commit_id[:12]} read without signature verification (verify_signatures=False)"),
                stacklevel=3,
            )
        return
    if not (settings.require_signatures or verify_signatures):
        return
    verdict = judge(commit_id, "commit", signatures_of(core).of(commit_id), settings.keys())
    if not verdict.good:
        raise refuse(verdict, "reading it")


def signature_summary(
    core: Repository, object_id: str, kind: ObjectKind = "commit", trusted: Mapping[str, PublicKey] | None = None
) -> Verification:
    """For log/show/the web UI: the verdict on ``object_id`` (one listing of its own
    folder; pass ``trusted`` to read the trusted keys once for many objects)."""
    keys = TrustSettings.load(core).keys() if trusted is None else trusted
    return judge(object_id, kind, signatures_of(core).of(object_id), keys)


def signatures_json(core: Repository, object_ids: Iterable[str]) -> dict[str, dict[str, Any] | None]:
    """``log --json``'s "signature" of each commit: its verdict where it has a record or
    trusted keys are set (so "unsigned" means something), else None."""
    keys = TrustSettings.load(core).keys()
    out: dict[str, dict[str, Any] | None] = {}
    for oid in object_ids:
        verdict = signature_summary(core, oid, trusted=keys)
        out[oid] = verdict.to_json() if keys or verdict.status != "unsigned" else None
    return out


def show_json(core: Repository, commit_id: str, tag_id: str | None) -> dict[str, Any]:
    """``show --json``'s signature fields: the commit's ("signature", as
    :func:`signatures_json`) and, for an annotated tag, the tag's ("tag_signature")."""
    out: dict[str, Any] = {"signature": signatures_json(core, [commit_id])[commit_id]}
    if tag_id is not None:
        keys = TrustSettings.load(core).keys()
        verdict = signature_summary(core, tag_id, "tag", trusted=keys)
        out["tag_signature"] = verdict.to_json() if keys or verdict.status != "unsigned" else None
    return out


def short_text(verdict: Verification) -> str:
    """One line for log/show: "good (alice, key 3f2a...)", "none", "BAD: ...", "untrusted (...)"."""
    if verdict.status == "good":
        return f"good, by {verdict.signer} (key {verdict.key_id and verdict.key_id[:16]})"
    if verdict.status == "unsigned":
        return "none"
    if verdict.status == "untrusted":
        return f"untrusted key {verdict.key_id and verdict.key_id[:16]} (claims {verdict.signer!r})"
    return f"BAD: {verdict.problems[0]}"
