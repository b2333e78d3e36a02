"""Signing and verification: ``ckvc keygen``, ``ckvc sign``, ``ckvc verify-commit``
and ``ckvc verify-tag`` (the commit's ``-S`` and the tag's ``-s`` live with those verbs)."""

from __future__ import annotations

from pathlib import Path

import click

from ckvc.cli.main import Context, cli
from ckvc.cli.output import emit_json, human_bytes, json_option, time_text
from ckvc.errors import InvalidInputError


@cli.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--type", "algorithm", type=click.Choice(["ed25519", "ecdsa-p256"]), default="ed25519", show_default=True)
@json_option
@click.pass_obj
def keygen(obj: Context, path: Path, algorithm: str, as_json: bool) -> None:
    """Make a signing key: the private key at PATH (mode 0600) and its public key at
    PATH.pub. Give PATH to `ckvc config sign_key`, PATH.pub to the verifiers."""
    from ckvc.signing import allowed_signers_line, generate_key

    key = generate_key(Path(obj.directory) / path, algorithm)
    public = key.path.with_name(key.path.name + ".pub")
    if as_json:
        emit_json({"private_key": str(key.path), "public_key": str(public), "key_id": key.key_id, "type": algorithm})
        return
    click.echo(f"Private key: {key.path}\nPublic key:  {public}\nKey id:      {key.key_id[:16]} ({algorithm})")
    click.echo(f"As a trusted-keys line: {allowed_signers_line(key.public)}")


@cli.command()
@click.argument("rev", required=False, default="HEAD")
@json_option
@click.pass_obj
def sign(obj: Context, rev: str, as_json: bool) -> None:
    """Sign the commit REV after the fact with the configured key (sign_key): history
    made before signing was on, vouched for now. push carries the signature."""
    signature = obj.repo.sign(rev)
    if as_json:
        emit_json({"commit": signature.object, "key_id": signature.key_id, "signer": signature.signer})
    else:
        click.echo(f"Signed commit {signature.object[:12]} with {signature.signer} (key {signature.key_id[:16]})")


def _report(verdict_json: dict[str, object], text: str, as_json: bool) -> None:
    if as_json:
        emit_json(verdict_json)
    else:
        click.echo(text)


@cli.command("verify-commit")
@click.argument("rev", required=False, default="HEAD")
@json_option
@click.pass_obj
def verify_commit(obj: Context, rev: str, as_json: bool) -> None:
    """Check that a trusted key signed REV: exit 0 with the signer's name and key id;
    exit 38 (SignatureError) when it is unsigned, badly signed or signed by a key
    not in trusted_keys."""
    verdict = obj.repo.verify_commit(rev)
    assert verdict.time_ns is not None and verdict.key_id is not None
    text = f"{verdict.describe()}, signed {time_text(verdict.time_ns)}"
    _report(verdict.to_json(), text, as_json)


@cli.command("verify-tag")
@click.argument("name")
@json_option
@click.pass_obj
def verify_tag(obj: Context, name: str, as_json: bool) -> None:
    """Check that a trusted key signed the annotated tag NAME (exit codes as verify-commit)."""
    verdict = obj.repo.verify_tag(name)
    assert verdict.time_ns is not None
    _report(verdict.to_json(), f"{verdict.describe()}, signed {time_text(verdict.time_ns)}", as_json)


@cli.command("verify-export")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--key", "key_path", required=True, metavar="PUB.pem", help="The signer's public key.")
@click.option(
    "--signature", default=None, metavar="FILE", help="The bundle (default: PATH/model.sig, or PATH.sig for a file)."
)
@json_option
@click.pass_obj
def verify_export(obj: Context, path: Path, key_path: str, signature: str | None, as_json: bool) -> None:
    """Check an exported folder or file against its OpenSSF model-signing bundle, as
    `model_signing verify key` does: the signature with KEY, then every file's SHA-256
    (a changed, missing or unsigned file: exit 38)."""
    from ckvc.formats.sigstore_bundle import SIGNATURE_NAME, verify_folder
    from ckvc.signing import public_key_from_pem

    base = Path(obj.directory)
    target = base / path
    where = base / key_path
    try:
        pem = where.read_bytes()
    except OSError as exc:
        raise InvalidInputError(f"public key {where}: {exc.strerror or exc}") from None
    public = public_key_from_pem(pem, where.stem, str(where))
    default = target / SIGNATURE_NAME if target.is_dir() else target.with_name(target.name + ".sig")
    result = verify_folder(target, base / signature if signature else default, public)
    if as_json:
        emit_json(result.to_json())
    else:
        click.echo(f"Verified {result.files} file(s), {human_bytes(result.bytes)}, signed by {public.name}")
