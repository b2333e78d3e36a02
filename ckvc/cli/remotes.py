"""The remote commands: remote add|remove|list, push, fetch, pull, clone, ls-remote.

No torch: a push or fetch moves stored records and never decodes a tensor.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ckvc.cli.main import Context, cli
from ckvc.cli.output import emit_json, human_bytes, json_option, progress_bar
from ckvc.errors import InvalidInputError

if TYPE_CHECKING:
    from ckvc.remote.common import FetchResult, PushResult, TransferStats
    from ckvc.remote.push import MirrorResult


def _rate(stats: TransferStats) -> str:
    per_s = stats.wire_bytes / stats.seconds if stats.seconds > 0 else 0.0
    return (
        f"{stats.objects} objects, {human_bytes(stats.wire_bytes)} in {stats.packs} pack(s), "
        f"{stats.seconds:.2f} s ({human_bytes(per_s)}/s), {stats.requests} requests"
    )


def _ref_lines(updates: Iterator[tuple[str, str | None, str, bool]]) -> Iterator[str]:
    for ref, old, new, forced in updates:
        if old is None:
            yield f" * [new] {ref} -> {new[:12]}"
        else:
            yield f" {'+' if forced else ' '} {old[:12]}..{new[:12]} {ref}"


@cli.group(invoke_without_command=True)
@json_option
@click.pass_context
def remote(ctx: click.Context, as_json: bool) -> None:
    """List, add or remove remotes (URLs: a path, file://, s3://, gs://, az://)."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(remote_list, as_json=as_json)


@remote.command("list")
@json_option
@click.pass_obj
def remote_list(obj: Context, as_json: bool) -> None:
    """List the configured remotes."""
    specs = obj.repo.remotes.list()
    if as_json:
        emit_json([s.to_json() for s in specs])
        return
    for s in specs:
        extra = "".join(f" {k}={v}" for k, v in (("endpoint", s.endpoint), ("region", s.region)) if v)
        click.echo(f"{s.name}\t{s.url}{extra}")


@remote.command("add")
@click.argument("name")
@click.argument("url")
@click.option("--endpoint", default=None, metavar="URL", help="An S3-compatible endpoint (MinIO, Ceph).")
@click.option("--region", default=None, help="The bucket's region.")
@json_option
@click.pass_obj
def remote_add(obj: Context, name: str, url: str, endpoint: str | None, region: str | None, as_json: bool) -> None:
    """Add remote NAME at URL (no credentials are stored: each cloud's environment provides them)."""
    if "://" not in url and not Path(url).is_absolute():
        url = str((Path(obj.directory) / url).resolve())
    spec = obj.repo.remotes.add(name, url, endpoint=endpoint, region=region)
    if as_json:
        emit_json(spec.to_json())
    else:
        click.echo(f"Added remote {spec.name} at {spec.url}")


@remote.command("remove")
@click.argument("name")
@json_option
@click.pass_obj
def remote_remove(obj: Context, name: str, as_json: bool) -> None:
    """Remove remote NAME, its remote-tracking branches and its local catalog."""
    spec = obj.repo.remotes.remove(name)
    if as_json:
        emit_json({"removed": spec.to_json()})
    else:
        click.echo(f"Removed remote {spec.name}")


def _report(result: PushResult | FetchResult, as_json: bool, verb: str) -> None:
    if as_json:
        emit_json(result.to_json())
        return
    click.echo(f"{verb} {result.url}: {_rate(result.stats)}")
    for line in _ref_lines((u.ref, u.old, u.new, u.forced) for u in result.updated):
        click.echo(line)


@cli.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False, default="origin")
@click.argument("refs", nargs=-1)
@click.option("--force", "-f", is_flag=True, help="Move remote refs even where commits would be dropped.")
@click.option("--tags", is_flag=True, help="Push every tag too.")
@click.option("--all", "all_branches", is_flag=True, help="Push every local branch.")
@click.option("--mirror", is_flag=True, help="Make REMOTE's branches and tags exactly these (forced; others deleted).")
@json_option
@click.pass_obj
def push(
    obj: Context,
    remote_name: str,
    refs: tuple[str, ...],
    force: bool,
    tags: bool,
    all_branches: bool,
    mirror: bool,
    as_json: bool,
) -> None:
    """Send what REMOTE lacks of REF... (default: the current branch; --all: every
    branch), then move its refs. --mirror: every branch and tag, forced, and REMOTE's
    refs that this repository lacks deleted."""
    if mirror:
        if refs or all_branches or tags or force:
            raise InvalidInputError("push --mirror takes no REF, --all, --tags or --force: it sends everything")
        with progress_bar("push", not as_json) as progress:
            mirrored = obj.repo.push_mirror(remote_name, progress=progress)
        _mirror_report(mirrored, as_json)
        return
    if all_branches and refs:
        raise InvalidInputError("push --all takes no REF: it pushes every branch")
    wanted = list(obj.repo.branches()) if all_branches else list(refs)
    with progress_bar("push", not as_json) as progress:
        result = obj.repo.push(remote_name, wanted or None, force=force, tags=tags, progress=progress)
    _report(result, as_json, "To")
    if not as_json and not result.updated:
        click.echo("Everything up-to-date")


def _mirror_report(result: MirrorResult, as_json: bool) -> None:
    if as_json:
        emit_json(result.to_json())
        return
    stats = result.stats
    click.echo(
        f"Mirrored {result.source} to {result.target}: {stats.objects} objects, {human_bytes(stats.record_bytes)} "
        f"in {stats.packs} packs ({human_bytes(stats.wire_bytes)} sent)"
    )
    for line in _ref_lines((u.ref, u.old, u.new, u.forced) for u in result.updated):
        click.echo(line)
    for ref, old in result.deleted.items():
        click.echo(f" - [deleted]         {ref} (was {old[:12]})")
    if not result.updated and not result.deleted:
        click.echo("Everything up-to-date")


@cli.command()
@click.argument("source")
@click.argument("target")
@click.option("--source-endpoint", default=None, metavar="URL", help="SOURCE's S3-compatible endpoint.")
@click.option("--target-endpoint", default=None, metavar="URL", help="TARGET's S3-compatible endpoint.")
@click.option("--prune", is_flag=True, help="Delete TARGET's branches and tags that SOURCE lacks.")
@json_option
@click.pass_obj
def mirror(
    obj: Context,
    source: str,
    target: str,
    source_endpoint: str | None,
    target_endpoint: str | None,
    prune: bool,
    as_json: bool,
) -> None:
    """Copy every branch and tag of SOURCE (a remote URL, or a repository's path) to
    TARGET (a URL; made if it holds no repository), sending only what TARGET lacks,
    streamed and verified, with no local copy. A killed mirror resumes where it stopped."""
    from ckvc.repo import Repo

    base = Path(obj.directory)
    if "://" not in source:
        source = str((base / source).resolve())
    if "://" not in target:
        target = str((base / target).resolve())
    with progress_bar("mirror", not as_json) as progress:
        result = Repo.mirror(
            source, target, source_endpoint=source_endpoint, target_endpoint=target_endpoint, prune=prune,
            progress=progress,
        )  # fmt: skip
    _mirror_report(result, as_json)


@cli.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False, default="origin")
@json_option
@click.pass_obj
def fetch(obj: Context, remote_name: str, as_json: bool) -> None:
    """Copy what REMOTE's branches and tags reach, verified; move refs/remotes/REMOTE/*."""
    with progress_bar("fetch", not as_json) as progress:
        result = obj.repo.fetch(remote_name, progress=progress)
    _report(result, as_json, "From")


@cli.command()
@click.argument("remote_name", metavar="[REMOTE]", required=False, default="origin")
@json_option
@click.pass_obj
def pull(obj: Context, remote_name: str, as_json: bool) -> None:
    """fetch, then fast-forward the current branch to REMOTE's."""
    with progress_bar("pull", not as_json) as progress:
        result = obj.repo.pull(remote_name, progress=progress)
    if as_json:
        emit_json(result.to_json())
        return
    _report(result.fetch, False, "From")
    if result.fast_forward and result.new is not None:
        old = result.old[:12] if result.old else "(none)"
        click.echo(f"Fast-forward {result.branch}: {old}..{result.new[:12]}")
    else:
        click.echo("Already up to date.")


@cli.command()
@click.argument("url")
@click.argument("directory", required=False)
@click.option("--endpoint", default=None, metavar="URL", help="An S3-compatible endpoint.")
@click.option("--region", default=None, help="The bucket's region.")
@click.option("--lazy", is_flag=True, help="Refs and metadata only: tensor data is fetched on first read.")
@click.option(
    "--trusted-keys", default=None, metavar="PATH", help="The clone's trusted keys (a PEM file, folder or list)."
)
@click.option(
    "--require-signatures", is_flag=True, help="Refuse unless a trusted key signed the remote's refs (and later reads)."
)
@json_option
@click.pass_obj
def clone(
    obj: Context,
    url: str,
    directory: str | None,
    endpoint: str | None,
    region: str | None,
    lazy: bool,
    trusted_keys: str | None,
    require_signatures: bool,
    as_json: bool,
) -> None:
    """Make a new repository in DIRECTORY from URL (as remote origin), like git clone.
    --lazy: a cache in front of the remote (log, show, du work at once; data on first read).
    --require-signatures with --trusted-keys: the remote's branches and tags must be
    signed by a trusted key, checked before anything is copied."""
    from ckvc.repo import Repo

    base = Path(obj.directory)
    if "://" not in url and not Path(url).is_absolute():
        url = str((base / url).resolve())
    name = directory or Path(url.rstrip("/")).name.removesuffix(".ckvc") or "clone"
    target = base / name
    with progress_bar("clone", not as_json) as progress:
        repo = Repo.clone(
            url, target, endpoint=endpoint, region=region, progress=progress, lazy=lazy,
            trusted_keys=None if trusted_keys is None else base / trusted_keys,
            require_signatures=require_signatures,
        )  # fmt: skip
    try:
        branch, head_id = repo.head()
        if as_json:
            emit_json({"path": str(repo.path), "branch": branch, "head": head_id, **({"lazy": True} if lazy else {})})
        else:
            how = "Cloned (lazy: data on first read)" if lazy else "Cloned"
            click.echo(f"{how} {url} into {repo.path}" + (f" (branch {branch})" if head_id else " (empty)"))
    finally:
        repo.close()


@cli.command("ls-remote")
@click.argument("remote_name", metavar="[REMOTE]", required=False, default="origin")
@json_option
@click.pass_obj
def ls_remote(obj: Context, remote_name: str, as_json: bool) -> None:
    """List REMOTE's refs (a configured name, or a URL)."""
    refs = obj.repo.ls_remote(remote_name)
    if as_json:
        emit_json(refs)
        return
    for ref, oid in refs.items():
        click.echo(f"{oid}\t{ref}")
