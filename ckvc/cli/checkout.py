"""Checkpoints out: ``ckvc checkout`` (move HEAD, with -o also write the state) and
``ckvc export`` (write a commit without moving HEAD); a DCP commit leaves as a DCP
directory. torch loads inside the command bodies."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from ckvc.cli.main import Context, cli
from ckvc.cli.output import emit_json, json_option, progress_bar, warn
from ckvc.errors import InvalidInputError

if TYPE_CHECKING:
    from ckvc.repo import Repo


output_option = click.option(
    "-o", "--output", type=click.Path(path_type=Path), default=None, help="Also write the state here."
)


@cli.command()
@click.argument("rev", required=False, default=None)
@output_option
@click.option("-b", "new_branch", default=None, metavar="NAME", help="Create branch NAME at REV and move onto it.")
@json_option
@click.pass_obj
def checkout(obj: Context, rev: str | None, output: Path | None, new_branch: str | None, as_json: bool) -> None:
    """Move HEAD to REV (onto it if REV is a branch, else detached); with -o also
    write its state (.pt, .safetensors, or a directory). To write a commit without
    moving HEAD, use ckvc export; to start a branch there, -b NAME."""
    repo = obj.repo
    if rev is None:
        if new_branch is None:
            raise InvalidInputError("checkout needs a REV (or -b NAME to branch from HEAD)")
        rev = "HEAD"
    written: list[Path] = []
    # What would refuse the move (a damaged HEAD, an existing -b branch) refuses
    # before any file is written, so a refused checkout leaves everything as it was.
    was_branch, _ = repo.head()
    if new_branch is not None:
        from ckvc.graph import check_new_branch

        check_new_branch(repo.core, new_branch)
    if output is not None:
        from ckvc.errors import ReadOnlyRepositoryError
        from ckvc.formats import export_commit
        from ckvc.storage.durable import require_writable

        if not output.is_absolute():
            output = Path(obj.directory) / output
        try:
            require_writable(repo.dir, "moving HEAD")
            read_only = False
        except ReadOnlyRepositoryError:
            if new_branch is not None:
                raise  # -b asks for a write: refused before any output
            read_only = True
        if _is_dcp(repo, rev):
            written = _export_dcp(repo, rev, output)
        else:
            with progress_bar("checkout", not as_json) as progress:
                written = export_commit(repo, rev, output, progress=progress)
        if read_only:
            # What the caller can have from a repository it cannot write: the files.
            warn(f"the repository is read-only: HEAD was not moved (ckvc export {rev} OUT says so up front)")
            if as_json:
                emit_json({"commit": repo.resolve(rev), "branch": repo.head()[0], "written": [str(p) for p in written]})
            else:
                for p in written:
                    click.echo(f"wrote {p}")
            return
    commit_id = repo.switch(rev, new_branch=new_branch)
    branch, _ = repo.head()
    if branch is None and was_branch is not None:
        warn(
            f"HEAD is now detached at {commit_id[:12]} (it was on branch '{was_branch}'); new commits will be on "
            f"no branch. To write a commit without moving HEAD: ckvc export {rev} OUT; to go back: ckvc switch "
            f"{was_branch}; to branch here: ckvc switch -c NAME"
        )
    if as_json:
        emit_json({"commit": commit_id, "branch": branch, "written": [str(p) for p in written]})
        return
    where = f"branch '{branch}'" if branch else f"detached HEAD at {commit_id[:12]}"
    click.echo(f"Switched to {'a new ' if new_branch else ''}{where}")
    for p in written:
        click.echo(f"wrote {p}")


def _is_dcp(repo: Repo, rev: str) -> bool:
    """A commit torch.distributed.checkpoint wrote through ckvc.dcp.Writer."""
    from ckvc.integrations import DCP_METADATA_KEY

    return DCP_METADATA_KEY in repo.read_commit(repo.resolve(rev)).metadata


def _export_dcp(repo: Repo, rev: str, output: Path) -> list[Path]:
    """A DCP commit leaves as a plain DCP directory (FileSystemWriter's layout), for
    dcp.load with FileSystemReader and the tools that read only that."""
    from ckvc.integrations.dcp import export_dcp

    export_dcp(repo, rev, output)
    return sorted(p for p in output.iterdir() if p.is_file())


@cli.command()
@click.argument("rev")
@click.argument("output", type=click.Path(path_type=Path))
@click.option(
    "--prefix", default=None, metavar="PREFIX", help="Only the leaves under PREFIX (e.g. model.), renamed without it."
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["pt", "safetensors", "dir", "hf"]),
    default=None,
    help="Output kind (default: the commit's own kind, else OUTPUT's suffix).",
)
@click.option("--max-shard-size", default=None, metavar="SIZE", help="--format hf: shards of at most SIZE (5GiB).")
@click.option("--config", "config_from", default=None, metavar="PATH", help="--format hf: config files to carry.")
@click.option(
    "--sign-key",
    default=None,
    metavar="KEY.pem",
    help="Also write an OpenSSF model-signing bundle (OUTPUT/model.sig, or OUTPUT.sig for a file); ECDSA P-256.",
)
@json_option
@click.pass_obj
def export(
    obj: Context,
    rev: str,
    output: Path,
    prefix: str | None,
    fmt: str | None,
    max_shard_size: str | None,
    config_from: str | None,
    sign_key: str | None,
    as_json: bool,
) -> None:
    """Write commit REV to OUTPUT without moving HEAD: e.g. the weights alone of a
    training state as one file, ckvc export HEAD model.safetensors --prefix model.
    --sign-key: a bundle `model_signing verify key` (and `ckvc verify-export`) accepts."""
    from ckvc.formats import export_commit
    from ckvc.signing import load_signing_key

    repo = obj.repo
    if not output.is_absolute():
        output = Path(obj.directory) / output
    if prefix is not None and not prefix.endswith("."):
        prefix += "."  # "model" means the leaves under model
    key = None if sign_key is None else load_signing_key(Path(obj.directory) / sign_key)
    if (max_shard_size is not None or config_from is not None) and fmt != "hf":
        raise InvalidInputError("--max-shard-size and --config go with --format hf")
    if fmt == "hf":
        if prefix is not None or key is not None:
            raise InvalidInputError("--format hf takes no --prefix or --sign-key")
        from ckvc.integrations.hf_export import DEFAULT_SHARD_BYTES, export_hf
        from ckvc.retention_policy import parse_size

        shard = parse_size(max_shard_size) if max_shard_size is not None else DEFAULT_SHARD_BYTES
        if shard is None:
            raise InvalidInputError(f"--max-shard-size takes a size such as 2GiB, got {max_shard_size!r}")
        config = Path(obj.directory) / config_from if config_from is not None else None
        with progress_bar("export", not as_json) as progress:
            written = export_hf(repo, rev, output, max_shard_bytes=shard, config_from=config, progress=progress)
    elif fmt is None and prefix is None and _is_dcp(repo, rev):
        if key is not None:
            raise InvalidInputError("a DCP commit exports as a DCP folder, which is not signed; give --format")
        written = _export_dcp(repo, rev, output)
    else:
        with progress_bar("export", not as_json) as progress:
            written = export_commit(
                repo,
                rev,
                output,
                format=fmt,  # type: ignore[arg-type]
                prefix=prefix,
                progress=progress,
                sign_key=key,
            )
    commit_id = repo.resolve(rev)
    if as_json:
        emit_json({"commit": commit_id, "written": [str(p) for p in written]})
        return
    for p in written:
        click.echo(f"wrote {p}")
