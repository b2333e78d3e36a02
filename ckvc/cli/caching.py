"""``ckvc cache``: the local chunk cache in front of a remote (usage, hit rate,
pins), ``cache pin REV`` / ``unpin REV``, ``cache prune``. Imports no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from ckvc.cli.main import Context, cli
from ckvc.cli.output import emit_json, human_bytes, json_option

if TYPE_CHECKING:
    from ckvc.hybrid.cache import CacheReport


def _text(r: CacheReport) -> list[str]:
    h = human_bytes
    budget = "unlimited" if r.budget is None else h(r.budget)
    rate = "n/a" if r.hit_rate is None else f"{100 * r.hit_rate:.1f}%"
    lines = [
        f"cache: {h(r.used_bytes)} in {r.packs} packs, budget {budget}" + (" (lazy clone)" if r.lazy else ""),
        f"  held by a remote (may be dropped): {h(r.evictable_bytes)}; local only (kept): {h(r.unpushed_bytes)}",
        f"  hit rate {rate} over {r.reads} reads ({h(r.hit_bytes)} hit, {h(r.miss_bytes)} fetched)",
        f"  evicted {r.evicted_packs} packs ({h(r.evicted_bytes)}); policy {r.policy}; "
        f"remotes: {', '.join(r.promisors) or 'none'}",
    ]
    lines += [f"  pinned {cid[:12]} ({label})" for cid, label in r.pins.items()]
    return lines


@cli.group(invoke_without_command=True)
@json_option
@click.pass_context
def cache(ctx: click.Context, as_json: bool) -> None:
    """The local chunk cache: usage against cache_size, hit rate, pins."""
    if ctx.invoked_subcommand is None:
        report = ctx.obj.repo.cache.report()
        if as_json:
            emit_json(report.to_json())
        else:
            for line in _text(report):
                click.echo(line)


@cache.command("pin")
@click.argument("rev")
@json_option
@click.pass_obj
def cache_pin(obj: Context, rev: str, as_json: bool) -> None:
    """Keep REV's data local whatever the budget says."""
    commit_id = obj.repo.cache.pin(rev)
    if as_json:
        emit_json({"pinned": commit_id, "rev": rev})
    else:
        click.echo(f"pinned {commit_id[:12]} ({rev})")


@cache.command("unpin")
@click.argument("rev")
@json_option
@click.pass_obj
def cache_unpin(obj: Context, rev: str, as_json: bool) -> None:
    """Let REV's data be dropped again (when a remote holds it)."""
    commit_id = obj.repo.cache.unpin(rev)
    if as_json:
        emit_json({"unpinned": commit_id, "rev": rev})
    else:
        click.echo(f"unpinned {commit_id[:12]} ({rev})")


@cache.command("prune")
@json_option
@click.pass_obj
def cache_prune(obj: Context, as_json: bool) -> None:
    """Trim the cache to cache_size now (only data a remote holds goes)."""
    result = obj.repo.cache.prune()
    if as_json:
        emit_json(result.to_json())
        return
    h = human_bytes
    click.echo(
        f"{h(result.before_bytes)} -> {h(result.after_bytes)}: {result.packs_deleted} packs deleted, "
        f"{result.packs_rewritten} rewritten, {h(result.bytes_freed)} freed"
    )
    if result.over_budget_bytes:
        click.echo(f"still {h(result.over_budget_bytes)} over budget: data no remote holds (push it) or pinned")
