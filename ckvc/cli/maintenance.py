"""Maintenance: ``ckvc fsck`` (exit 1 on damage), ``gc``, ``retain`` (retention
policies) and ``du`` (where the space goes)."""

from __future__ import annotations

import dataclasses
import sys
from typing import TYPE_CHECKING

import click

from ckvc.cli.main import FSCK_DAMAGE_EXIT, Context, cli
from ckvc.cli.output import echo_codecs, emit_json, human_bytes, json_option, progress_bar, warn
from ckvc.errors import InvalidInputError

if TYPE_CHECKING:
    from ckvc.remote.repair import RepairReport


def _duration_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _parse_fraction(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise InvalidInputError(f"--sample takes a percentage like 10% or a fraction like 0.1, got {text!r}") from None
    if not 0 < value <= 1:
        raise InvalidInputError(f"--sample must be in (0%, 100%], got {text!r}")
    return value


@cli.command()
@click.option("--rebuild-index", is_flag=True, help="Rebuild the index from the pack files first.")
@click.option(
    "--level",
    type=click.Choice(["refs", "metadata", "full"]),
    default="full",
    show_default=True,
    help="refs: refs and commit graph; metadata: also snapshots and chunk presence; full: also re-hash all data.",
)
@click.option("--full", "full_flag", is_flag=True, help="Same as --level full (the default).")
@click.option("--sample", default=None, metavar="PCT", help="Re-hash a random sample of objects, e.g. 10%.")
@click.option(
    "--remote", "remote_name", default=None, metavar="NAME", help="Check remote NAME (with --repair: repair from it)."
)
@click.option(
    "--repair", is_flag=True, help="Fetch damaged or missing objects again from the remotes, verified; drop the damage."
)
@json_option
@click.pass_obj
def fsck(
    obj: Context,
    rebuild_index: bool,
    level: str,
    full_flag: bool,
    sample: str | None,
    remote_name: str | None,
    repair: bool,
    as_json: bool,
) -> None:
    """Verify the refs, the commit graph and every stored byte against its hash.
    Exits 1 and names each damaged object, and the commits and tensors it breaks,
    when anything is wrong. --repair restores what a remote holds."""
    fraction = _parse_fraction(sample)
    if full_flag:
        level = "full"
    elif fraction is not None and level == "full":
        level = "metadata"  # the sample replaces the full read
    if repair and (fraction is not None or level != "full"):
        raise InvalidInputError("--repair reads every object (level full); it takes no --sample or --level")
    if remote_name is not None and rebuild_index and not repair:
        raise InvalidInputError("--rebuild-index checks the local index; a remote has none (its catalog is rebuilt)")
    repaired = None
    with progress_bar("fsck", not as_json) as progress:
        if repair:
            sources = None if remote_name is None else [remote_name]
            repaired = obj.repo.repair(sources, rebuild_index=rebuild_index, progress=progress)
            report = repaired.after
        elif remote_name is not None:
            report = obj.repo.fsck_remote(remote_name, level=level, sample=fraction, progress=progress)
        else:
            report = obj.repo.fsck(rebuild_index=rebuild_index, level=level, sample=fraction, progress=progress)
    if as_json:
        emit_json(report.to_json() if repaired is None else repaired.to_json())
    else:
        if repaired is not None:
            echo_repair(repaired)
        if report.rebuilt_index:
            click.echo("index rebuilt from packs")
        click.echo(
            f"checked {report.objects_checked} objects ({human_bytes(report.bytes_checked)}) in "
            f"{report.packs_checked} packs; {report.commits_reachable} reachable commits"
        )
        for p in report.problems:
            click.echo(f"{p.severity}: {p.kind}: {p.object_id or '-'}: {p.detail}")
            echo_breaks(p.object_id, p.breaks)
        click.echo("ok" if report.ok else f"DAMAGED: {len(report.damaged_objects())} objects")
    if not report.ok:
        sys.exit(FSCK_DAMAGE_EXIT)


def echo_repair(done: RepairReport) -> None:
    if not done.damaged:
        click.echo("repair: nothing damaged or missing")
        return
    fetched = sum(done.repaired.values())
    sources = ", ".join(f"{n} from {name}" for name, n in done.repaired.items()) or "none"
    click.echo(
        f"repair: {done.damaged} damaged or missing objects; {fetched} fetched again and verified ({sources}, "
        f"{human_bytes(done.repaired_bytes)}) into {done.packs_written} new packs; "
        f"{len(done.packs_dropped)} damaged packs dropped"
    )
    if done.dropped_unreferenced:
        click.echo(f"repair: {done.dropped_unreferenced} damaged objects nothing reaches were dropped with their packs")
    if done.unrepaired:
        tried = ", ".join(done.remotes_tried) or "no remote is configured"
        click.echo(f"repair: {len(done.unrepaired)} objects are still damaged (remotes tried: {tried})")


BREAKS_SHOWN = 3  # commits listed per damaged object; --json lists all


def echo_breaks(object_id: str | None, breaks: dict[str, list[str]]) -> None:
    for commit, paths in list(breaks.items())[:BREAKS_SHOWN]:
        what = ", ".join(paths) if paths else "the commit object" if commit == object_id else "its snapshot"
        click.echo(f"    breaks commit {commit[:12]}: {what}")
    if len(breaks) > BREAKS_SHOWN:
        click.echo(f"    breaks {len(breaks) - BREAKS_SHOWN} more commits (--json lists them)")


@cli.command()
@json_option
@click.pass_obj
def stats(obj: Context, as_json: bool) -> None:
    """The values `ckvc serve` exposes at /metrics (Prometheus): storage, commits and
    the newest commit's age per branch, commits not pushed per remote, auto_push's
    backlog, the cache."""
    from ckvc.metrics import as_json as metrics_json
    from ckvc.metrics import collect

    metrics = collect(obj.repo)
    if as_json:
        emit_json(metrics_json(metrics))
        return
    for m in metrics:
        for labels, value in m.samples:
            where = ",".join(f"{k}={v}" for k, v in labels.items())
            shown = human_bytes(value) if m.name.endswith(("_bytes", "_bytes_total")) else f"{value:g}"
            click.echo(f"{m.name}{'{' + where + '}' if where else ''}  {shown}")


@cli.command()
@json_option
@click.pass_obj
def du(obj: Context, as_json: bool) -> None:
    """Logical vs stored bytes, dedup and compression ratios, unique bytes per commit."""
    usage = obj.repo.du()
    if as_json:
        emit_json(usage.to_json())
        return
    click.echo(f"commits:           {usage.commits}")
    click.echo(f"logical:           {human_bytes(usage.logical_bytes)}")
    click.echo(f"unique (raw):      {human_bytes(usage.unique_raw_bytes)}   dedup x{usage.dedup_ratio:.2f}")
    click.echo(
        f"stored chunks:     {human_bytes(usage.stored_chunk_bytes)}   compression x{usage.compression_ratio:.2f}"
    )
    click.echo(
        f"packs on disk:     {human_bytes(usage.pack_bytes)} in {usage.pack_count} packs   "
        f"overall x{usage.total_ratio:.2f}"
    )
    if usage.pruned_commits:
        click.echo(f"pruned commits:    {usage.pruned_commits} (history kept, data released)")
    echo_codecs(usage.by_codec)
    if usage.by_key:
        click.echo("by top-level key:  logical / stored (distinct chunks)")
        for k in usage.by_key:
            click.echo(f"  {k.key:<16} {human_bytes(k.logical_bytes):>10} / {human_bytes(k.stored_bytes):>10}")
    if usage.per_commit:
        click.echo("unique bytes per commit (what pruning it alone would free):")
        for c in usage.per_commit:
            first = c.message.splitlines()[0] if c.message else ""
            size = "pruned" if c.pruned else human_bytes(c.unique_stored_bytes)
            click.echo(f"  {c.commit[:12]}  {size:>10}  {first}")


@cli.command()
@click.option("--keep-last", type=int, default=None, metavar="N", help="Keep the last N commits of each branch.")
@click.option("--keep-best", multiple=True, metavar="METRIC:min|max:N", help="Keep the N best by a metric.")
@click.option("--keep-every", type=int, default=None, metavar="K", help="Keep every K-th commit (root = 0).")
@click.option("--keep-within", default=None, metavar="DURATION", help="Keep commits younger than e.g. 7d, 12h.")
@click.option(
    "--max-size", default=None, metavar="SIZE", help="Also keep the newest commits whose data fits in e.g. 50GiB."
)
@click.option("--branch", "branches", multiple=True, metavar="B", help="Only prune on these branches.")
@click.option("--auto/--no-auto", default=None, help="Apply the stored policy after every commit.")
@click.option("--remote", "remote", default=None, metavar="NAME", help="Apply it to this remote's branches.")
@click.option("--dry-run", is_flag=True, help="Show what would be released and why the rest is kept.")
@json_option
@click.pass_obj
def retain(
    obj: Context,
    keep_last: int | None,
    keep_best: tuple[str, ...],
    keep_every: int | None,
    keep_within: str | None,
    max_size: str | None,
    branches: tuple[str, ...],
    auto: bool | None,
    remote: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Apply a retention policy: commits no rule keeps are pruned (history and
    metrics stay; `ckvc gc` frees their data once their packs are older than the
    gc_grace period, `ckvc gc --now` at once). Rules given here are stored as the
    repository's policy; with none, the stored policy is used. With --remote the
    rules apply to that remote's branches (`ckvc gc --remote` frees the data) and
    nothing is stored."""
    from ckvc.retention_policy import KeepBest, RetentionPolicy, parse_duration, parse_size

    repo = obj.repo
    stored = repo.retention_policy()
    budget = parse_size(max_size) if max_size is not None else None
    if max_size is not None and budget is None:
        raise InvalidInputError(f"--max-size takes a size such as 50GiB, got {max_size!r}")
    if keep_last or keep_best or keep_every or keep_within or budget is not None:
        policy = RetentionPolicy(
            keep_last=keep_last,
            keep_best=tuple(KeepBest.parse(b) for b in keep_best),
            keep_every=keep_every,
            keep_within_s=parse_duration(keep_within) if keep_within else None,
            branches=branches or None,
            auto=bool(auto) if auto is not None else bool(stored and stored.auto),
            max_size=budget,
        )
    elif stored is not None:
        policy = stored
        if branches or auto is not None:
            policy = dataclasses.replace(
                policy, branches=branches or policy.branches, auto=policy.auto if auto is None else auto
            )
    else:
        raise InvalidInputError("no retention policy stored; give rules, e.g. ckvc retain --keep-last 3")
    if remote is not None:
        if auto is not None:
            raise InvalidInputError("--auto applies to this repository's commits; it takes no --remote")
        plan = repo.retain_remote(remote, policy, dry_run=dry_run)
    else:
        plan = repo.retain(policy, dry_run=dry_run)
        if not dry_run and policy != stored:
            repo.set_retention(policy)
    if as_json:
        emit_json({**plan.to_json(), "dry_run": dry_run})
        return
    click.echo(f"policy: {policy.describe()}{' (auto)' if policy.auto else ''}")
    verb = "would release" if dry_run else "released"
    click.echo(
        f"{verb} {len(plan.released)} commits; keeping {len(plan.kept)}; {len(plan.already_pruned)} pruned before"
    )
    for cid, reasons in plan.kept.items():
        msg = plan.summaries.get(cid, "")
        click.echo(f"  keep    {cid[:12]}  {msg:<24.24} {'; '.join(reasons)}")
    for cid in plan.released:
        msg = plan.summaries.get(cid, "")
        frees = f"  frees {human_bytes(plan.frees[cid])}" if cid in plan.frees else ""
        click.echo(f"  release {cid[:12]}  {msg:<24.24}{frees}")
    if plan.kept_bytes is not None:
        click.echo(
            f"kept data: {human_bytes(plan.kept_bytes)}; {'would free' if dry_run else 'gc frees'} "
            f"{human_bytes(sum(plan.frees.values()))}"
        )
    if plan.over_budget:
        warn(plan.over_budget)
    if not dry_run and plan.released and remote is not None:
        click.echo(f"their data is freed by `ckvc gc --remote {remote}` (whole packs whose every record is released)")
    elif not dry_run and plan.released:
        grace = _duration_text(repo.config.gc_grace_s)
        click.echo(
            f"their data is freed by `ckvc gc`, except packs written in the last {grace} (gc_grace), "
            "which gc keeps for concurrent writers; `ckvc gc --now` frees those too "
            "(only when nothing else is writing to this repository)"
        )


@cli.command()
@click.option("--remote", "remote", default=None, metavar="NAME", help="Scrub this remote's packs (read remotely).")
@click.option("--budget", "budget", default=None, metavar="DURATION", help="Stop after e.g. 10m (between packs).")
@click.option("--bytes", "byte_budget", default=None, metavar="SIZE", help="Stop after reading e.g. 50GiB of packs.")
@json_option
@click.pass_obj
def scrub(obj: Context, remote: str | None, budget: str | None, byte_budget: str | None, as_json: bool) -> None:
    """Verify, a budget at a time, the packs not verified for the longest, until every
    pack has been read once in a cycle; resumable (killed, it loses at most one pack).
    Exit 1 while damage found by a scrub is on record; repairs nothing (ckvc fsck --repair)."""
    from ckvc.retention_policy import parse_duration, parse_size
    from ckvc.scrub import ScrubReport

    seconds = parse_duration(budget) if budget is not None else None
    size = parse_size(byte_budget) if byte_budget is not None else None
    if byte_budget is not None and size is None:
        raise InvalidInputError(f"--bytes takes a size such as 50GiB, got {byte_budget!r}")
    with progress_bar("scrub", not as_json) as progress:
        report: ScrubReport = obj.repo.scrub(remote, max_bytes=size, max_seconds=seconds, progress=progress)
    if as_json:
        emit_json(report.to_json())
    else:
        where = f"remote {remote}" if remote else "this repository"
        click.echo(
            f"scrub of {where}, cycle {report.cycle}: verified {len(report.packs_verified)} packs "
            f"({human_bytes(report.bytes_verified)}, {report.objects_verified} objects) in {report.seconds:.1f} s; "
            + ("cycle complete" if report.cycle_complete else f"{report.coverage:.0%} of the cycle's packs done")
        )
        last = report.last_complete
        if last is not None:
            click.echo(f"last complete cycle: {last['cycle']}, {last['packs']} packs, {human_bytes(last['bytes'])}")
        for pack, problem in report.known_damage.items():
            click.echo(f"DAMAGE in pack {pack}: {problem}")
    if not report.ok:
        sys.exit(1)


@cli.command()
@click.option("--dry-run", is_flag=True, help="Only print what would be reclaimed.")
@click.option("--now", is_flag=True, help="Skip the grace period (only when nothing else is writing).")
@click.option("--grace", default=None, metavar="DURATION", help="Grace period for young packs (default from config).")
@click.option("--remote", "remote", default=None, metavar="NAME", help="Collect the packs of this remote instead.")
@json_option
@click.pass_obj
def gc(obj: Context, dry_run: bool, now: bool, grace: str | None, remote: str | None, as_json: bool) -> None:
    """Reclaim space: delete what no ref, recent reflog entry or unpruned commit
    needs, and repack mostly-dead packs."""
    from ckvc.retention_policy import format_duration, parse_duration

    if remote is not None:
        done = obj.repo.gc_remote(remote, dry_run=dry_run, now=now, grace_s=parse_duration(grace) if grace else None)
        if as_json:
            emit_json(done.to_json())
            return
        click.echo(
            f"remote {done.remote}: {done.live_objects} live objects; {done.count('delete')} of "
            f"{len(done.packs)} packs to delete ({human_bytes(done.bytes_to_delete)}), "
            f"{done.count('young')} in the grace period"
        )
        if done.executed:
            click.echo(f"freed {human_bytes(done.bytes_freed)}: {done.packs_deleted} packs deleted")
            if done.kept_revived:
                click.echo(f"{len(done.kept_revived)} packs kept: a concurrent push needs them")
        return
    report = obj.repo.gc(dry_run=dry_run, now=now, grace_s=parse_duration(grace) if grace else None)
    if as_json:
        emit_json(report.to_json())
        return
    plan = report.plan
    click.echo(
        f"live: {plan.live_objects} objects, {human_bytes(plan.live_bytes)}; "
        f"reclaimable: {human_bytes(plan.reclaimable_bytes)} "
        f"({plan.count('delete')} packs to delete, {plan.count('repack')} to repack, "
        f"{plan.count('young')} in the grace period)"
    )
    if plan.reflog_commits:
        click.echo(
            f"kept by reflog entries younger than {format_duration(obj.repo.config.reflog_expiry_s)}: "
            f"{plan.reflog_commits} commit(s), {human_bytes(plan.reflog_bytes)} "
            "(`ckvc reflog expire --all --expire=now` lets gc free them)"
        )
    if plan.grace_bytes:
        click.echo(
            f"in packs younger than the grace period ({format_duration(plan.grace_s)}): "
            f"{human_bytes(plan.grace_bytes)} (`ckvc gc --now` does not wait for it)"
        )
    if not plan.reclaimable_bytes and not plan.reflog_commits and not plan.grace_bytes:
        click.echo("nothing to reclaim: a branch, tag or HEAD reaches every object")
    if report.executed:
        click.echo(
            f"freed {human_bytes(report.bytes_freed)}: {report.packs_deleted} packs deleted, "
            f"{report.packs_repacked} repacked into {report.packs_written}, in {report.seconds:.2f} s "
            f"(writers blocked {report.critical_section_s * 1000:.0f} ms)"
        )
        if report.kept_revived:
            click.echo(f"{len(report.kept_revived)} packs kept: a concurrent commit needs them")


@cli.command()
@click.argument("revs", nargs=-1)
@click.option("--eval", "evaluate", required=True, metavar="MODULE:FUNCTION", help="Called with the loaded state.")
@click.option("--metric", default=None, metavar="NAME", help="What a function returning one number measures.")
@click.option("--rtol", type=float, default=1e-6, show_default=True, help="Relative tolerance.")
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--all", "all_commits", is_flag=True, help="Every commit any branch reaches (pruned ones skipped).")
@click.option("--branch", "branches", multiple=True, metavar="B", help="The commits of branch B.")
@click.option("--since", default=None, metavar="DURATION", help="Only commits younger than e.g. 7d.")
@click.option("--no-note", is_flag=True, help="Do not record the outcome as a note.")
@json_option
@click.pass_obj
def validate(
    obj: Context,
    revs: tuple[str, ...],
    evaluate: str,
    metric: str | None,
    rtol: float,
    atol: float,
    all_commits: bool,
    branches: tuple[str, ...],
    since: str | None,
    no_note: bool,
    as_json: bool,
) -> None:
    """Re-run an evaluation on commits and compare with the metrics they recorded:
    each commit is loaded in a fresh interpreter, MODULE:FUNCTION (importable from the
    current directory) gets the state and returns a number or a dict of metrics, and the
    outcome is recorded as a note. Exit 1 when any commit mismatches."""
    import time

    from ckvc.retention_policy import parse_duration

    repo = obj.repo
    pruned = repo.pruned()
    chosen: list[str] = [repo.resolve(r) for r in revs]
    if all_commits:
        chosen += [c.id for c in repo.log(all=True)]
    for branch in branches:
        chosen += [c.id for c in repo.log(branch, first_parent=True)]
    if not (revs or all_commits or branches):
        chosen.append(repo.resolve("HEAD"))
    if since is not None:
        horizon = time.time_ns() - int(parse_duration(since) * 1e9)
        chosen = [c for c in chosen if repo.read_commit(c).time_ns >= horizon]
    chosen = [c for c in dict.fromkeys(chosen) if c not in pruned]
    results = []
    for commit_id in chosen:
        result = repo.validate(
            commit_id, evaluate, metric=metric, rtol=rtol, atol=atol, record=not no_note, fresh_process=True
        )
        results.append(result)
        if not as_json:
            click.echo(f"{commit_id[:12]}  {result.summary()}")
    if as_json:
        emit_json({"ok": all(r.ok for r in results), "commits": [r.to_json() for r in results]})
    elif not chosen:
        click.echo("no commit to validate")
    if not all(r.ok for r in results):
        sys.exit(1)
