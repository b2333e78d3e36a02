"""Checkpoints in: ``ckvc commit`` (one file or directory) and ``ckvc import`` (a
folder of checkpoints, one commit each). torch loads inside the command bodies."""

from __future__ import annotations

from pathlib import Path

import click

from ckvc.cli.main import Context, cli
from ckvc.cli.output import emit_json, human_bytes, json_option, metrics_text, progress_bar, time_text, warn
from ckvc.errors import InvalidInputError


def parse_pairs(pairs: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"{what} must look like key=value, got {pair!r}")
        out[key] = value
    return out


def metric_values(pairs: tuple[str, ...]) -> dict[str, float]:
    """--metric K=V options as metrics (InvalidInputError for a value that is no number)."""
    out: dict[str, float] = {}
    for key, value in parse_pairs(pairs, "--metric").items():
        try:
            out[key] = float(value)
        except ValueError:
            raise InvalidInputError(f"metric {key!r} is not a number: {value!r}") from None
    return out


@cli.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("-m", "--message", default="", help="Commit message.")
@click.option("--metric", "metrics", multiple=True, metavar="K=V", help="A metric, e.g. --metric val_loss=0.31.")
@click.option("--meta", "meta", multiple=True, metavar="K=V", help="A metadata string.")
@click.option(
    "--lossy",
    "lossy",
    multiple=True,
    metavar="PRESET|GLOB=MODE",
    help="Opt-in lossy storage: a preset (compact, optimizer-q8, optimizer-q4, compact-q4) or e.g. 'optimizer.*=q4'.",
)
@click.option("--follow-links", is_flag=True, help="Store what symlinks leaving the directory point to.")
@click.option(
    "--strict",
    is_flag=True,
    help="Refuse a .pt/.safetensors file that does not parse (default: store its bytes, warn).",
)
@click.option(
    "-S/--no-sign",
    "--sign",
    "sign",
    default=None,
    help="Sign the commit with the configured key (sign_key); default: the sign_commits setting.",
)
@json_option
@click.pass_obj
def commit(
    obj: Context,
    path: Path,
    message: str,
    metrics: tuple[str, ...],
    meta: tuple[str, ...],
    lossy: tuple[str, ...],
    follow_links: bool,
    strict: bool,
    sign: bool | None,
    as_json: bool,
) -> None:
    """Commit a checkpoint: a torch.save file, a .safetensors file, or a directory of them.
    A file named like one that does not parse is stored as bytes with a warning
    (--strict: refused, nothing committed)."""
    numbers = metric_values(metrics)
    repo = obj.repo
    if not path.is_absolute():
        path = Path(obj.directory) / path
    from ckvc import signing
    from ckvc.formats import read_checkpoint

    signing.signer_for(repo.core, sign)  # a key that does not load fails before the checkpoint is read

    with progress_bar("read", not as_json) as progress:
        state, source_meta = read_checkpoint(path, follow_links=follow_links, progress=progress, strict=strict)
    metadata = {**source_meta, **parse_pairs(meta, "--meta")}
    lossy_spec: str | dict[str, str] | None = None
    if len(lossy) == 1 and "=" not in lossy[0]:
        lossy_spec = lossy[0]
    elif lossy:
        lossy_spec = parse_pairs(lossy, "--lossy")
    with progress_bar("commit", not as_json) as progress:
        commit_id = repo.commit(
            state, message=message, metrics=numbers, metadata=metadata, progress=progress, lossy=lossy_spec,
            on_conflict="retry",  # another writer's commit meanwhile: this one goes on top of it
            sign=sign,
        )  # fmt: skip
    stats = repo.last_commit_stats
    assert stats is not None
    branch, _ = repo.head()
    if branch is None:
        warn(
            f"committed on a detached HEAD: {commit_id[:12]} is on no branch and only the reflog keeps it; "
            f"to keep it: ckvc branch NAME {commit_id[:12]}"
        )
    if as_json:
        emit_json(
            {
                "commit": commit_id,
                "branch": branch,
                "logical_bytes": stats.logical_bytes,
                "chunks": stats.chunks,
                "new_chunks": stats.new_chunks,
                "stored_bytes": stats.stored_bytes,
                "seconds": stats.seconds,
                "lossy": {p: dict(r) for p, r in repo.read_commit(commit_id).lossy.items()},
            }
        )
    else:
        click.echo(
            f"[{branch or 'detached HEAD'} {commit_id[:12]}] {message}\n"
            f" {human_bytes(stats.logical_bytes)} in {stats.chunks} chunks, {stats.new_chunks} new; "
            f"{human_bytes(stats.stored_bytes)} written in {stats.seconds:.2f} s"
        )


@cli.command("import")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--branch", default=None, metavar="NAME", help="Import onto NAME (default: HEAD's branch).")
@click.option("--glob", default=None, metavar="PATTERN", help="Only entries matching PATTERN, e.g. 'ckpt_*.pt'.")
@click.option("--dry-run", is_flag=True, help="List the commits it would make, write nothing.")
@json_option
@click.pass_obj
def import_cmd(obj: Context, source: Path, branch: str | None, glob: str | None, dry_run: bool, as_json: bool) -> None:
    """Turn a folder of checkpoints (epoch_*.pt, ckpt_*.pt, checkpoint-N/, Lightning
    *.ckpt, DCP step folders) into one commit each, in numeric order, with metrics from
    trainer_state.json, Lightning file names or JSON sidecars and the files' times.
    Rerunning continues an interrupted import; nothing is committed twice."""
    from ckvc.importer import import_checkpoints

    if not source.is_absolute():
        source = Path(obj.directory) / source
    with progress_bar("import", not as_json and not dry_run) as progress:
        result = import_checkpoints(obj.repo, source, branch=branch, glob=glob, dry_run=dry_run, progress=progress)
    if as_json:
        emit_json(result.to_json())
        return
    plan = result.plan
    for name, reason in plan.skipped:
        click.echo(f"skipped {name}: {reason}")
    for c in plan.checkpoints:
        if c.name in plan.done:
            click.echo(f"already imported as {plan.done[c.name][:12]}: {c.message}")
            continue
        head = "would commit:" if dry_run else f"[{plan.branch} {result.imported[c.name][:12]}]"
        metrics = f"  [{metrics_text(c.metrics)}]" if c.metrics else ""
        click.echo(f"{head} {c.message}  {time_text(c.time_ns)}{metrics}")
    verb = "would import" if dry_run else "imported"
    click.echo(
        f"{verb} {len(plan.todo)} of {len(plan.checkpoints)} checkpoints onto branch {plan.branch}"
        + (f" ({len(plan.done)} already there)" if plan.done else "")
    )
