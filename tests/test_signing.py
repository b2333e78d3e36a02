"""Signed commits and tags (ckvc.signing): keys, the record format, verification
verdicts, the require_signatures policy on every read path, and the tamper cases.
Remotes (push/fetch/clone carrying signatures) are in tests/remote/test_signatures_remote.py."""

from __future__ import annotations

import base64
import json
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from helpers import assert_state_equal, run

import ckvc
from ckvc import signing
from ckvc.errors import CkvcWarning, InvalidInputError, SignatureError

# FORMAT.md section 21's vector: this seed's key signs commit VECTOR_OBJECT at VECTOR_TIME.
VECTOR_SEED = bytes(range(32))
VECTOR_OBJECT = "ab" * 32
VECTOR_TIME = 1_700_000_000_000_000_000


def write_vector_key(path: Path) -> Path:
    key = ed25519.Ed25519PrivateKey.from_private_bytes(VECTOR_SEED)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.write_bytes(pem)
    return path


def keys(tmp_path: Path, name: str, algorithm: str = "ed25519") -> tuple[Path, Path]:
    """A key pair made as `ckvc keygen` makes it: (private, public)."""
    key = signing.generate_key(tmp_path / name, algorithm)
    return key.path, key.path.with_name(key.path.name + ".pub")


def state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}, "step": seed}


@pytest.fixture
def signed(make_repo: Any, tmp_path: Path) -> tuple[ckvc.Repo, Path, Path]:
    """A repository with sign_key and trusted_keys set (not yet requiring signatures)."""
    repo = make_repo()
    private, public = keys(tmp_path, "alice")
    signing.set_trust(repo.core, "sign_key", str(private))
    signing.set_trust(repo.core, "trusted_keys", str(public))
    return repo, private, public


# ---- the record ---------------------------------------------------------------------


def test_signature_record_vector(tmp_path: Path) -> None:
    """The bytes of a record are fixed by its fields (Ed25519 signs deterministically)."""
    key = signing.load_signing_key(write_vector_key(tmp_path / "vector.pem"))
    sig = signing.make_signature(key, VECTOR_OBJECT, "commit", time_ns=VECTOR_TIME)
    message = sig.message()
    assert message.startswith(b"ckvc signature v1\n{")
    assert json.loads(message.split(b"\n", 1)[1]) == {
        "algorithm": "ed25519",
        "format": 1,
        "key_id": key.key_id,
        "object": VECTOR_OBJECT,
        "signer": "vector",
        "time_ns": VECTOR_TIME,
        "type": "commit",
    }
    encoded = sig.encode()
    assert signing.Signature.decode(encoded) == sig
    assert encoded.endswith(b"\n") and b" " not in encoded
    public = key.public
    assert public.verifies(sig.signature, message)
    assert not public.verifies(sig.signature, message + b"x")
    # The vector in docs/FORMAT.md section 21.
    assert key.key_id == VECTOR_KEY_ID
    assert blake_of(encoded) == VECTOR_RECORD_BLAKE3
    assert signing.SignatureStore.key(sig) == f"signatures/{VECTOR_OBJECT}/{sig.id}.json"


def blake_of(data: bytes) -> str:
    import blake3

    return blake3.blake3(data).hexdigest()


VECTOR_KEY_ID = "0af3d9166132932cf22056d410f797dd7121de119e74a698025d4c062c4864ab"
VECTOR_RECORD_BLAKE3 = "d71fc2c84e60cf09a7180022ee94c73949cca51650569b16743582f78b6f498c"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: {**d, "format": 2},
        lambda d: {**d, "object": "AB" * 32},
        lambda d: {**d, "type": "snapshot"},
        lambda d: {**d, "time_ns": -1},
        lambda d: {**d, "extra": 1},
        lambda d: {k: v for k, v in d.items() if k != "signer"},
        lambda d: {**d, "signature": "not base64!"},
    ],
)
def test_malformed_records_are_refused(tmp_path: Path, mutate: Any) -> None:
    key = signing.load_signing_key(write_vector_key(tmp_path / "k.pem"))
    data = json.loads(signing.make_signature(key, VECTOR_OBJECT, "commit", time_ns=1).encode())
    bad = json.dumps(mutate(data), sort_keys=True, separators=(",", ":")).encode() + b"\n"
    with pytest.raises(ValueError):
        signing.Signature.decode(bad)


def test_both_algorithms_sign_and_verify(tmp_path: Path) -> None:
    for algorithm in signing.ALGORITHMS:
        private, public = keys(tmp_path, f"k-{algorithm}", algorithm)
        assert oct(private.stat().st_mode & 0o777) == "0o600"
        key = signing.load_signing_key(private)
        assert key.algorithm == algorithm
        trusted = signing.trusted_keys(public)
        sig = signing.make_signature(key, VECTOR_OBJECT, "commit")
        verdict = signing.judge(VECTOR_OBJECT, "commit", [("k", sig)], trusted)
        assert verdict.good and verdict.signer == f"k-{algorithm}" and verdict.key_id == key.key_id


def test_keys_are_never_overwritten_and_bad_keys_are_typed(tmp_path: Path) -> None:
    private, public = keys(tmp_path, "k")
    with pytest.raises(InvalidInputError, match="never overwrites"):
        signing.generate_key(private)
    with pytest.raises(InvalidInputError, match="not a PEM private key"):
        signing.load_signing_key(public)
    with pytest.raises(InvalidInputError, match="No such file"):
        signing.load_signing_key(tmp_path / "missing")
    encrypted = tmp_path / "enc.pem"
    encrypted.write_bytes(
        ed25519.Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    with pytest.raises(InvalidInputError, match="encrypted"):
        signing.load_signing_key(encrypted)
    with pytest.raises(InvalidInputError, match="key type"):
        signing.generate_key(tmp_path / "x", "rsa")


def test_trusted_keys_file_folder_and_list(tmp_path: Path) -> None:
    _, alice = keys(tmp_path, "alice")
    _, bob = keys(tmp_path, "bob", "ecdsa-p256")
    folder = tmp_path / "trusted"
    folder.mkdir()
    (folder / "alice.pem").write_bytes(alice.read_bytes())
    (folder / "bob.pub").write_bytes(bob.read_bytes())
    (folder / "notes.txt").write_text("ignored")
    by_folder = signing.trusted_keys(folder)
    assert sorted(k.name for k in by_folder.values()) == ["alice", "bob"]
    listing = tmp_path / "allowed"
    lines = [signing.allowed_signers_line(k) for k in by_folder.values()]
    listing.write_text("# who may sign\n\n" + "\n".join(lines) + "\n")
    assert signing.trusted_keys(listing).keys() == by_folder.keys()
    assert [k.name for k in signing.trusted_keys(alice).values()] == ["alice.pub"[:-4]]
    listing.write_text("carol not-base64\n")
    with pytest.raises(InvalidInputError, match="line 1"):
        signing.trusted_keys(listing)


# ---- commits ----------------------------------------------------------------------


def test_signing_changes_no_commit_id(signed: Any, make_repo: Any) -> None:
    repo, _, _ = signed
    plain = make_repo("plain")
    when = 1_700_000_000_000_000_000
    os.environ["CKVC_AUTHOR"] = "tester"
    try:
        a = repo.commit(state(), "one", time_ns=when, sign=True)
        b = plain.commit(state(), "one", time_ns=when)
    finally:
        del os.environ["CKVC_AUTHOR"]
    assert a == b
    verdict = repo.verify_commit(a)
    assert verdict.good and verdict.signer == "alice"
    with pytest.raises(SignatureError, match="not signed"):
        plain.verify_commit(b)


def test_sign_commits_setting_and_sign_false(signed: Any) -> None:
    repo, _, _ = signed
    unsigned = repo.commit(state(1), "plain")
    with pytest.raises(SignatureError, match="not signed"):
        repo.verify_commit(unsigned)
    signing.set_trust(repo.core, "sign_commits", "true")
    auto = repo.commit(state(2), "auto")
    assert repo.verify_commit(auto).good
    never = repo.commit(state(3), "never", sign=False)
    with pytest.raises(SignatureError):
        repo.verify_commit(never)
    pending = repo.commit(state(4), "background", blocking=False)
    assert repo.verify_commit(pending.result()).good


def test_a_key_that_does_not_load_commits_nothing(make_repo: Any, tmp_path: Path) -> None:
    repo = make_repo()
    with pytest.raises(InvalidInputError, match="no signing key"):
        repo.commit(state(), "x", sign=True)
    assert repo.head() == ("main", None)
    with pytest.raises(InvalidInputError, match="sign_commits needs a key"):
        signing.set_trust(repo.core, "sign_commits", "true")
    private, _ = keys(tmp_path, "k")
    signing.set_trust(repo.core, "sign_key", str(private))
    private.unlink()
    with pytest.raises(InvalidInputError, match="signing key"):
        repo.commit(state(), "x", sign=True)
    assert repo.head() == ("main", None) and not list((repo.core.local_dir / "packs").glob("*.pack"))


def test_after_the_fact_signing_and_verdicts(signed: Any, tmp_path: Path) -> None:
    repo, _, _ = signed
    old = repo.commit(state(1), "before signing")
    sig = repo.sign(old)
    assert sig.object == old and repo.verify_commit(old).good
    # a second, untrusted signature beside a good one does not spoil it
    mallory, _ = keys(tmp_path, "mallory")
    signing.sign(repo.core, old, "commit", signing.load_signing_key(mallory))
    assert repo.verify_commit(old).good
    # only an untrusted signature: refused, naming what it claims
    other = repo.commit(state(2), "mallory's")
    signing.sign(repo.core, other, "commit", signing.load_signing_key(mallory))
    with pytest.raises(SignatureError, match=r"'mallory'.*not a trusted key"):
        repo.verify_commit(other)


# ---- the policy on every read path -----------------------------------------------------


def read_paths(repo: ckvc.Repo, rev: str, out: Path, **kw: Any) -> dict[str, Any]:
    """Each read path of the issue, as a callable reading ``rev``."""
    from torch.distributed.checkpoint import load as dcp_load

    from ckvc import distributed
    from ckvc.dcp import Reader
    from ckvc.formats.export import export_commit

    model = torch.nn.Linear(64, 64)
    target = {"model.w": torch.empty(64, 64)}
    return {
        "load": lambda: repo.load(rev, **kw),
        "view": lambda: repo.view(rev, **kw)["model.w"],
        "load_into": lambda: repo.load_into(rev, model=model, strict=False, **kw),
        "checkout": lambda: repo.checkout(rev, **kw),
        "export": lambda: export_commit(repo, rev, out / "x.pt", **kw),
        "distributed.load": lambda: distributed.load(repo, rev, rank=0, **kw),
        "dcp.Reader": lambda: dcp_load(target, storage_reader=Reader(repo, rev, **kw), no_dist=True),
    }


def test_require_signatures_refuses_every_read_path_before_reading(signed: Any, tmp_path: Path) -> None:
    from helpers import counting_reads

    repo, _, _ = signed
    good = repo.commit(state(1), "signed", sign=True)
    bad = repo.commit(state(2), "unsigned")
    head = repo.head()
    signing.set_trust(repo.core, "require_signatures", "true")
    reads = counting_reads(repo)
    from torch.distributed.checkpoint.api import CheckpointException

    for name, read in read_paths(repo, bad, tmp_path).items():
        # DCP reports a storage reader's error inside its own exception type, message kept
        expected = CheckpointException if name == "dcp.Reader" else SignatureError
        with pytest.raises(expected, match=f"commit {bad[:12]} is not signed.*refused"):
            read()
        assert reads == [], f"{name} read objects before refusing"
    assert repo.head() == head and not (tmp_path / "x.pt").exists()
    with pytest.raises(SignatureError):
        repo.diff(good, bad)  # compares tensor values: a read too
    assert repo.diff(good, bad, data=False).changed  # --stat reads no tensor byte
    assert_state_equal(repo.load(good), state(1))  # the signed one reads
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_state_equal(repo.load(bad, verify_signatures=False), state(2))
    assert any(issubclass(w.category, CkvcWarning) and "without signature verification" in str(w.message)
               for w in caught)  # fmt: skip


def test_verify_signatures_true_checks_without_the_policy(signed: Any) -> None:
    repo, _, _ = signed
    bad = repo.commit(state(2), "unsigned")
    assert_state_equal(repo.load(bad), state(2))
    with pytest.raises(SignatureError):
        repo.load(bad, verify_signatures=True)


def test_environment_sets_the_policy(make_repo: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = make_repo()
    private, public = keys(tmp_path, "ci")
    monkeypatch.setenv("CKVC_SIGN_KEY", str(private))
    monkeypatch.setenv("CKVC_SIGN_COMMITS", "1")
    signed_id = repo.commit(state(1), "by CI")
    monkeypatch.delenv("CKVC_SIGN_COMMITS")
    unsigned = repo.commit(state(2), "by hand")
    monkeypatch.setenv("CKVC_TRUSTED_KEYS", str(public))
    monkeypatch.setenv("CKVC_REQUIRE_SIGNATURES", "true")
    assert_state_equal(repo.load(signed_id), state(1))
    with pytest.raises(SignatureError):
        repo.load(unsigned)
    monkeypatch.setenv("CKVC_REQUIRE_SIGNATURES", "maybe")
    with pytest.raises(InvalidInputError, match="true or false"):
        repo.load(signed_id)


# ---- tampering ---------------------------------------------------------------------------


def _records(repo: ckvc.Repo, oid: str) -> list[Path]:
    return sorted((repo.core.local_dir / "signatures" / oid).glob("*.json"))


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def tamper(repo: ckvc.Repo, case: str, first: str, second: str, tmp_path: Path) -> tuple[str, str]:
    """Apply one tamper case; returns (the commit to read, what the refusal must say).
    ``first`` is signed by the trusted key, ``second`` not."""
    good = _records(repo, first)[0]
    folder = repo.core.local_dir / "signatures" / second
    folder.mkdir(parents=True, exist_ok=True)
    if case == "moved":  # the good record copied under another commit
        (folder / good.name).write_bytes(good.read_bytes())
        return second, f"signs commit {first[:12]}, not this commit"
    if case == "modified":  # the record edited to name the other commit
        record = json.loads(good.read_bytes())
        record["object"] = second
        (folder / "forged.json").write_bytes(_canonical(record))
        return second, "does not verify"
    if case == "untrusted":  # re-signed with a key nobody trusts
        mallory = signing.generate_key(tmp_path / "mallory")
        signing.sign(repo.core, second, "commit", mallory)
        return second, "not a trusted key"
    assert case == "flipped"  # one bit of the good signature
    record = json.loads(good.read_bytes())
    raw = bytearray(base64.b64decode(record["signature"]))
    raw[0] ^= 1
    record["signature"] = base64.b64encode(bytes(raw)).decode()
    good.write_bytes(_canonical(record))
    return first, "does not verify"


@pytest.mark.parametrize("case", ["moved", "modified", "untrusted", "flipped"])
def test_tamper_cases_are_refused_on_every_read_path(signed: Any, tmp_path: Path, case: str) -> None:
    from helpers import counting_reads
    from torch.distributed.checkpoint.api import CheckpointException

    repo, _, _ = signed
    first = repo.commit(state(1), "one", sign=True)
    second = repo.commit(state(2), "two")
    signing.set_trust(repo.core, "require_signatures", "true")
    target, says = tamper(repo, case, first, second, tmp_path)
    head = repo.head()
    reads = counting_reads(repo)
    for name, read in read_paths(repo, target, tmp_path).items():
        expected = CheckpointException if name == "dcp.Reader" else SignatureError
        with pytest.raises(expected, match=re.escape(says)):
            read()
        assert reads == [], f"{name} read objects before refusing"
    assert repo.head() == head and not (tmp_path / "x.pt").exists()
    with pytest.raises(SignatureError, match=re.escape(says)):
        repo.verify_commit(target)


# ---- tags and the CLI ------------------------------------------------------------------------


def test_signed_tags(signed: Any) -> None:
    repo, _, _ = signed
    repo.commit(state(1), "one")
    with pytest.raises(InvalidInputError, match="annotated"):
        repo.tag("v0", sign=True)
    tag_id = repo.tag("v1", message="release", sign=True)
    verdict = repo.verify_tag("v1")
    assert verdict.good and verdict.object == tag_id and verdict.type == "tag"
    repo.tag("v2", message="unsigned")
    with pytest.raises(SignatureError, match="not signed"):
        repo.verify_tag("v2")


def test_cli_sign_verify_and_show(tmp_path: Path) -> None:
    root = tmp_path / "w"
    assert run(tmp_path, "init", str(root)).exit_code == 0
    torch.save({"w": torch.arange(10.0)}, root / "a.pt")
    made = run(root, "keygen", "../key", "--json")
    assert made.exit_code == 0, made.output
    assert run(root, "config", "sign_key", "../key").exit_code == 0
    assert run(root, "config", "trusted_keys", "../key.pub").exit_code == 0
    committed = run(root, "commit", "a.pt", "-m", "one", "-S", "--json")
    assert committed.exit_code == 0, committed.output
    commit_id = json.loads(committed.stdout)["commit"]
    verified = run(root, "verify-commit", "--json")
    assert verified.exit_code == 0 and json.loads(verified.stdout)["signer"] == "key"
    assert "good signature on commit" in run(root, "verify-commit").stdout
    plain = run(root, "commit", "a.pt", "-m", "two", "--json")
    result = run(root, "verify-commit", "HEAD")
    assert result.exit_code == 38 and "is not signed" in result.output
    log = run(root, "log", "--oneline", "--show-signature").stdout.splitlines()
    assert "[not verified]" in log[0] and "[signed]" in log[1]
    shown = json.loads(run(root, "show", commit_id, "--no-data", "--json").stdout)
    assert shown["signature"]["status"] == "good"
    assert "Signature: none" in run(root, "show", "--no-data").stdout
    assert run(root, "tag", "-s", "-m", "release", "v1", commit_id).exit_code == 0
    assert run(root, "verify-tag", "v1").exit_code == 0
    assert run(root, "config", "require_signatures", "true").exit_code == 0
    refused = run(root, "export", "HEAD", "out.pt")
    assert refused.exit_code == 38 and not (root / "out.pt").exists()
    assert run(root, "sign", json.loads(plain.stdout)["commit"]).exit_code == 0
    assert run(root, "export", "HEAD", "out.pt").exit_code == 0
    config = json.loads(run(root, "config", "--json").stdout)
    assert config["require_signatures"] is True and config["sign_key"] == str(tmp_path / "key")
