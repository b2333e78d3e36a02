"""Signing and verification: ``ckvc keygen``, ``ckvc sign``, ``ckvc verify-commit``
and ``ckvc verify-tag`` (the commit's ``-S`` and the tag's ``-s`` live with those verbs)."""

from __future__ import annotations

from pathlib import Path

import click

from ckvc.cli.main import Context, cli
from ckvc.cli.output import emit_json, json_option, time_text


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
