"""Refs: ``ckvc branch``, ``tag`` and ``switch`` (move HEAD, no state read or written)."""

from __future__ import annotations

from typing import Any

import click

from ckvc.cli.main import Context, cli
from ckvc.cli.output import emit_json, json_option
from ckvc.errors import InvalidInputError


@cli.command()
@click.argument("name")
@click.argument("start", required=False, default=None)
@click.option("-c", "--create", is_flag=True, help="Create branch NAME at START (default HEAD) first.")
@json_option
@click.pass_obj
def switch(obj: Context, name: str, start: str | None, create: bool, as_json: bool) -> None:
    """Move HEAD onto branch NAME (no state is loaded or written); with -c create it
    at START first, like git switch -c."""
    from ckvc.errors import RefNotFoundError

    repo = obj.repo
    if create:
        commit_id = repo.switch(start or "HEAD", new_branch=name)
    else:
        if start is not None:
            raise InvalidInputError(f"a start point needs -c: ckvc switch -c {name} {start}")
        from ckvc.graph import branch_named, ref_hint

        if branch_named(repo.core, name) is None:
            hint = ref_hint(repo.core, name, tags=False) or f"; create it with: ckvc switch -c {name}"
            raise RefNotFoundError(f"no branch {name!r}{hint}")
        commit_id = repo.switch(name)
    if as_json:
        emit_json({"commit": commit_id, "branch": name, "created": create})
    else:
        click.echo(f"Switched to {'a new ' if create else ''}branch '{name}'")


@cli.command()
@click.option("-d", "--delete", is_flag=True, help="Delete the branch NAME, if HEAD or a remote holds its commits.")
@click.option("-D", "force_delete", is_flag=True, help="Delete the branch NAME even if nothing else holds its commits.")
@click.option("-f", "--force", is_flag=True, help="Move NAME to REV if it exists (not the branch HEAD is on).")
@click.option("-a", "--all", "all_branches", is_flag=True, help="Also list remote-tracking branches.")
@click.argument("name", required=False)
@click.argument("rev", required=False, default="HEAD")
@json_option
@click.pass_obj
def branch(
    obj: Context, delete: bool, force_delete: bool, force: bool, all_branches: bool, name: str | None, rev: str,
    as_json: bool,
) -> None:  # fmt: skip
    """List branches (with -a remote-tracking ones too), create NAME at REV (-f: or
    move it there), or delete NAME with -d (-D: even unmerged), as git branch does."""
    repo = obj.repo
    delete = delete or force_delete
    if name is None:
        if delete:
            raise InvalidInputError("branch -d needs a NAME")
        current, _ = repo.head()
        branches = repo.branches()
        remotes = repo.remote_branches() if all_branches else {}
        if as_json:
            emit_json({"current": current, "branches": branches, **({"remotes": remotes} if all_branches else {})})
        else:
            for n, oid in branches.items():
                click.echo(f"{'*' if n == current else ' '} {n:<20} {oid[:12]}")
            for n, oid in remotes.items():
                click.echo(f"  {'remotes/' + n:<20} {oid[:12]}")
        return
    if delete:
        oid = repo.delete_branch(name, unmerged=force_delete)
        _done(as_json, {"deleted": name, "was": oid}, f"Deleted branch {name} (was {oid[:12]})")
    elif force and name in repo.branches():
        was = repo.branches()[name]
        oid = repo.branch(name, rev, force=True)
        _done(
            as_json, {"moved": name, "was": was, "commit": oid}, f"Moved branch {name} to {oid[:12]} (was {was[:12]})"
        )
    else:
        oid = repo.branch(name, rev)
        _done(as_json, {"created": name, "commit": oid}, f"Created branch {name} at {oid[:12]}")


@cli.command()
@click.option("--hard", "mode", flag_value="hard", help="As git's: ckvc has no working tree, so the same as --soft.")
@click.option("--soft", "mode", flag_value="soft", help="Move the branch only (the default).")
@click.argument("rev")
@json_option
@click.pass_obj
def reset(obj: Context, mode: str | None, rev: str, as_json: bool) -> None:
    """Move the branch HEAD is on to REV (HEAD stays on it), as git reset does.
    The commits it leaves stay reachable through the reflog until it expires."""
    repo = obj.repo
    branch_name, was = repo.head()
    oid = repo.reset(rev)
    where = f"branch {branch_name}" if branch_name else "HEAD"
    _done(
        as_json, {"branch": branch_name, "was": was, "commit": oid},
        f"{where} is now at {oid[:12]}" + (f" (was {was[:12]})" if was else ""),
    )  # fmt: skip


@cli.command()
@click.option("-d", "--delete", is_flag=True, help="Delete the tag NAME.")
@click.option("-m", "--message", default=None, help="Make an annotated tag with this message.")
@click.option("-n", "lines", is_flag=True, help="List tags with the first line of their message.")
@click.option("-s", "--sign", is_flag=True, help="Make a signed annotated tag (needs -m and sign_key).")
@click.argument("name", required=False)
@click.argument("rev", required=False, default="HEAD")
@json_option
@click.pass_obj
def tag(
    obj: Context,
    delete: bool,
    message: str | None,
    lines: bool,
    sign: bool,
    name: str | None,
    rev: str,
    as_json: bool,
) -> None:
    """List tags (with -n, each with the first line of its message), create NAME at
    REV (annotated with -m; signed with -s), or delete NAME with -d."""
    repo = obj.repo
    if name is None:
        if delete:
            raise InvalidInputError("tag -d needs a NAME")
        tags = repo.tags()
        if not lines:
            if as_json:
                emit_json(tags)
            else:
                for n, oid in tags.items():
                    click.echo(f"{n:<20} {oid[:12]}")
            return
        # like git tag -n: an annotated tag's message, else its commit's
        annotated = {n: repo.tag_object(n) for n in tags}
        texts = {n: t.message if t is not None else repo.read_commit(tags[n]).message for n, t in annotated.items()}
        if as_json:
            emit_json(
                {
                    n: {"commit": oid, "annotated": annotated[n] is not None, "message": texts[n]}
                    for n, oid in tags.items()
                }
            )
        else:
            for n, oid in tags.items():
                first = texts[n].splitlines()[0] if texts[n] else ""
                click.echo(f"{n:<20} {oid[:12]}  {first}".rstrip())
        return
    if delete:
        oid = repo.delete_tag(name)
        _done(as_json, {"deleted": name, "was": oid}, f"Deleted tag {name} (was {oid[:12]})")
    else:
        oid = repo.tag(name, rev, message, sign=sign)
        _done(as_json, {"created": name, "target": oid}, f"Created tag {name} at {repo.resolve(name)[:12]}")


def _done(as_json: bool, payload: dict[str, Any], text: str) -> None:
    if as_json:
        emit_json(payload)
    else:
        click.echo(text)
