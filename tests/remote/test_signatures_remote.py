"""Signatures travel with push, fetch, clone and pull, to a directory remote and to
the S3 test server; with require_signatures a remote branch whose tip no trusted
key signed (an unsigned commit pushed by whoever can write the bucket) is refused
by fetch, pull and clone before anything is copied, the repository and the remote
unchanged."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from helpers import assert_state_equal, files_of, run
from test_remote import new_repo, state

import ckvc
from ckvc import signing
from ckvc.errors import SignatureError
from ckvc.remote.location import normalize_url, open_backend


@pytest.fixture(params=["dir", "s3"])
def remote_url(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    """(URL, endpoint): a directory remote, or an empty prefix in a fresh bucket on the S3 test server."""
    if request.param == "dir":
        return str(tmp_path / "remote"), None
    pytest.importorskip("obstore")
    pytest.importorskip("moto")
    server = request.getfixturevalue("s3_server")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/signed", server.endpoint


def trusting(repo: ckvc.Repo, private: Path | None, public: Path) -> ckvc.Repo:
    if private is not None:
        signing.set_trust(repo.core, "sign_key", str(private))
    signing.set_trust(repo.core, "trusted_keys", str(public))
    return repo


def key_pair(tmp_path: Path, name: str) -> tuple[Path, Path]:
    key = signing.generate_key(tmp_path / name)
    return key.path, key.path.with_name(key.path.name + ".pub")


def test_signatures_round_trip(tmp_path: Path, remote_url: tuple[str, str | None]) -> None:
    url, endpoint = remote_url
    private, public = key_pair(tmp_path, "alice")
    a = trusting(new_repo(tmp_path, "a"), private, public)
    first = a.commit(state(1), "one", sign=True)
    a.commit(state(2), "two", sign=True)
    tag = a.tag("v1", first, message="release", sign=True)
    a.remotes.add("origin", url, endpoint=endpoint)
    a.push("origin", ["main"], tags=True)
    b = ckvc.Repo.clone(url, tmp_path / "b", endpoint=endpoint, trusted_keys=public, require_signatures=True)
    assert b.verify_commit("HEAD").signer == "alice" and b.verify_commit(first).good
    assert b.verify_tag("v1").object == tag
    assert_state_equal(b.load("HEAD"), state(2))
    # a signature made after the push travels on the next push, refs up to date
    unsigned = a.commit(state(3), "three")
    a.push()
    with pytest.raises(SignatureError, match=f"commit {unsigned[:12]} is not signed"):
        b.pull()  # b requires signatures: the tip is unsigned
    a.sign(unsigned)
    assert a.push().up_to_date == ["refs/heads/main"]
    assert b.pull().fast_forward
    assert b.verify_commit("HEAD").good and b.load("HEAD")["step"] == 3
    a.close()
    b.close()


@pytest.mark.parametrize("case", ["unsigned", "untrusted", "moved", "modified"])
def test_a_tampered_tip_on_the_remote_is_refused(tmp_path: Path, remote_url: tuple[str, str | None], case: str) -> None:
    """Someone who can write the bucket pushes a commit on top of a signed branch,
    unsigned, signed by their own key, or with the good record copied (or edited) to
    name it: fetch, pull and clone refuse it before copying anything."""
    url, endpoint = remote_url
    private, public = key_pair(tmp_path, "alice")
    a = trusting(new_repo(tmp_path, "a"), private, public)
    good = a.commit(state(1), "one", sign=True)
    a.remotes.add("origin", url, endpoint=endpoint)
    a.push()
    b = ckvc.Repo.clone(url, tmp_path / "b", endpoint=endpoint, trusted_keys=public, require_signatures=True)
    mallory = new_repo(tmp_path, "m")
    mallory.remotes.add("origin", url, endpoint=endpoint)
    mallory.fetch()
    mallory.reset("origin/main")
    spliced = mallory.commit(state(9), "spliced")
    mallory.push()
    bucket = open_backend(normalize_url(url), endpoint=endpoint)
    record_key = next(k for k in bucket.list("signatures/") if k.startswith(f"signatures/{good}/"))
    record = bucket.get(record_key)
    assert record is not None
    if case == "untrusted":
        mallory_key, _ = key_pair(tmp_path, "mallory")
        theirs = signing.make_signature(signing.load_signing_key(mallory_key), spliced, "commit")
        bucket.put_if_absent(signing.SignatureStore.key(theirs), theirs.encode())
        says = "not a trusted key"
    elif case == "moved":
        bucket.put_if_absent(record_key.replace(good, spliced), record)
        says = f"signs commit {good[:12]}, not this commit"
    elif case == "modified":
        edited = json.loads(record)
        edited["object"] = spliced
        data = json.dumps(edited, sort_keys=True, separators=(",", ":")).encode() + b"\n"
        bucket.put_if_absent(f"signatures/{spliced}/edited.json", data)
        says = "does not verify"
    else:
        says = "is not signed"
    bucket.close()

    def content(repo: ckvc.Repo) -> dict[str, bytes]:  # the remote's catalog is a cache a refusal may refresh
        return {k: v for k, v in files_of(repo.core.local_dir).items() if "/catalog/" not in k}

    before = content(b)
    for action in (b.fetch, b.pull):
        with pytest.raises(SignatureError, match=re.escape(f"refs/heads/main: commit {spliced[:12]}")) as info:
            action()
        assert says in str(info.value)
    assert content(b) == before
    with pytest.raises(SignatureError, match="refs/heads/main"):
        ckvc.Repo.clone(url, tmp_path / "c", endpoint=endpoint, trusted_keys=public, require_signatures=True)
    assert not (tmp_path / "c").exists()
    # without the policy the same fetch goes through, and verification refuses the tip
    plain = ckvc.Repo.clone(url, tmp_path / "d", endpoint=endpoint, trusted_keys=public)
    with pytest.raises(SignatureError):
        plain.verify_commit("HEAD")
    for repo in (a, b, mallory, plain):
        repo.close()


def test_clone_cli_requires_signatures(tmp_path: Path) -> None:
    private, public = key_pair(tmp_path, "alice")
    a = trusting(new_repo(tmp_path, "a"), private, public)
    a.commit(state(1), "one")
    a.remotes.add("origin", str(tmp_path / "remote"))
    a.push()
    refused = run(tmp_path, "clone", str(tmp_path / "remote"), "c", "--trusted-keys", str(public),
                  "--require-signatures")  # fmt: skip
    assert refused.exit_code == 38 and "is not signed" in refused.output and not (tmp_path / "c").exists()
    a.sign("HEAD")
    a.push()
    cloned = run(tmp_path, "clone", str(tmp_path / "remote"), "c", "--trusted-keys", str(public),
                 "--require-signatures")  # fmt: skip
    assert cloned.exit_code == 0, cloned.output
    assert run(tmp_path / "c", "verify-commit").exit_code == 0
    assert run(tmp_path / "c", "config", "require_signatures").stdout.strip() == "require_signatures = true"
    a.close()


def test_push_without_signatures_sends_no_signature_requests(tmp_path: Path, s3_server: Any, s3_bucket: str) -> None:
    """A repository that never signed pays nothing on push (no listing of signatures/)."""
    pytest.importorskip("obstore")
    from ckvc.storage.cloud import ObjectStoreBackend

    a = new_repo(tmp_path, "a")
    a.commit(state(1), "one")
    a.remotes.add("origin", f"s3://{s3_bucket}/plain", endpoint=s3_server.endpoint)
    seen: list[str] = []
    original = ObjectStoreBackend.list

    def listing(self: ObjectStoreBackend, prefix: str = "", **kw: Any) -> Any:
        seen.append(prefix)
        return original(self, prefix, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ObjectStoreBackend, "list", listing)
        a.push()
        a.commit(state(2), "two", sign=False)
        a.push()
    assert seen and not any(p.startswith("signatures") for p in seen)
    a.close()
