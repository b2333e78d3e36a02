"""Reading history: ``ckvc log`` (with --graph), ``show``, ``diff``, ``reflog`` and
``status``. log, status, reflog and ``show --no-data`` read metadata only and
import no torch (tests/cli/test_cli_startup.py); diff and show load it to read tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

from ckvc.cli.main import Context, JsonErrorCommand, cli
from ckvc.cli.output import echo_codecs, emit_json, human_bytes, json_option, metrics_text, time_text
from ckvc.errors import InvalidInputError

if TYPE_CHECKING:
    from ckvc.inspect import StateDiff, TensorChange
    from ckvc.notes import Note
    from ckvc.objects import Commit, Tag
    from ckvc.repo import Repo


metric_mode_option = click.option(
    "--mode",
    type=click.Choice(["min", "max"]),
    default="min",
    show_default=True,
    help="For --sort/--best: whether the lowest or the highest value is best.",
)


@cli.command()
@click.argument("rev", default="HEAD")
@click.option("--oneline", is_flag=True, help="One line per commit.")
@click.option("-n", "--max-count", type=int, default=None, help="Show at most N commits.")
@click.option("--all", "all_refs", is_flag=True, help="Commits reachable from any branch, tag or HEAD.")
@click.option("--graph", is_flag=True, help="Draw the commit graph (branches and merges) on the left.")
@click.option("--sort", "sort_metric", default=None, metavar="METRIC", help="Only commits with METRIC, best first.")
@click.option("--best", "best_metric", default=None, metavar="METRIC", help="Only the best commit by METRIC.")
@metric_mode_option
@click.option("--show-signature", is_flag=True, help="Check each commit's signature against the trusted keys.")
@json_option
@click.pass_obj
def log(
    obj: Context,
    rev: str,
    oneline: bool,
    max_count: int | None,
    all_refs: bool,
    graph: bool,
    sort_metric: str | None,
    best_metric: str | None,
    mode: str,
    show_signature: bool,
    as_json: bool,
) -> None:
    """Show the commits reachable from REV, newest first, with their metrics
    (--show-signature: and who signed each, checked against trusted_keys)."""
    repo = obj.repo
    if sort_metric and best_metric:
        raise InvalidInputError("give --sort or --best, not both")
    if graph and (sort_metric or best_metric):
        raise InvalidInputError("--graph draws history order; it cannot be combined with --sort or --best")
    if best_metric:
        commits = [repo.best(best_metric, mode, rev, all=all_refs)]  # type: ignore[arg-type]
    elif sort_metric:
        commits = repo.rank(sort_metric, mode, rev, all=all_refs)[:max_count]  # type: ignore[arg-type]
        if not commits:
            repo.best(sort_metric, mode, rev, all=all_refs)  # type: ignore[arg-type]  # raises, naming the metrics
    else:
        commits = repo.log(rev, limit=max_count, all=all_refs)
    pruned = repo.pruned()
    verdicts = {}
    if show_signature and not as_json:  # --json always carries each commit's "signature"
        from ckvc import signing

        keys = signing.TrustSettings.load(repo.core).keys()
        verdicts = {c.id: signing.signature_summary(repo.core, c.id, trusted=keys) for c in commits}
    if as_json:
        from ckvc.inspect import history_json

        emit_json(history_json(repo.core, commits))
        return
    from ckvc import notes

    noted = notes.all_notes(repo.core)
    labels = _labels(repo)
    rows = _graph_rows(commits) if graph else (("", [], None, c) for c in commits)
    for node, opening, body, c in rows:
        if c is None:  # a connector line of the graph
            click.echo(node)
            continue
        lead = f"{node} " if node else ""
        cont = f"{body} " if body is not None else ""
        deco = f" ({', '.join(labels[c.id])})" if c.id in labels else ""
        first_line = c.message.splitlines()[0] if c.message else ""
        mark = (" [pruned]" if c.id in pruned else "") + (" [lossy]" if c.is_lossy else "")
        if oneline and c.id in verdicts:
            mark += " [signed]" if verdicts[c.id].good else " [not verified]"
        if oneline:
            shown = notes.metrics_with_notes(c, noted.get(c.id, ()))  # a note's newer value shows
            metrics = f"  [{metrics_text(shown)}]" if shown else ""
            click.echo(f"{lead}{c.id[:12]}{deco}{mark} {first_line}{metrics}")
            for line in opening:
                click.echo(line)
            continue
        lines = [f"commit {c.id}{deco}{mark}"]
        if c.id in pruned:
            lines.append(f"Pruned: {time_text(pruned[c.id].time_ns)} by [{pruned[c.id].policy}]")
        if len(c.parents) > 1:
            lines.append("Merge:  " + " ".join(p[:12] for p in c.parents))
        if c.id in verdicts:
            from ckvc.signing import short_text

            lines.append(f"Signature: {short_text(verdicts[c.id])}")
        lines += [f"Author: {c.author}", f"Date:   {time_text(c.time_ns)}"]
        if c.metrics:
            lines.append(f"Metrics: {metrics_text(c.metrics)}")
        lines += [_note_line(n) for n in noted.get(c.id, ())]
        lines.append("")
        lines += [f"    {line}" for line in (c.message or "(no message)").splitlines()]
        lines.append("")
        click.echo(lead + lines[0])
        for line in opening:
            click.echo(line)
        for line in lines[1:]:
            click.echo((cont + line).rstrip() if cont else line)


def _note_line(note: Note) -> str:
    """One note as log and show print it."""
    parts = [metrics_text(note.metrics)] if note.metrics else []
    if note.metadata:
        parts.append(" ".join(f"{k}={_meta_text(v)}" for k, v in note.metadata.items()))
    if note.message:
        parts.append(note.message.splitlines()[0])
    return f"Note:   {time_text(note.time_ns)} {note.author}: {'; '.join(parts)}"


def _graph_rows(commits: list[Commit]) -> Iterator[tuple[str, list[str], str | None, Commit | None]]:
    """git-style ASCII graph for commits in topological order (children first):
    (node prefix, the lines a merge opens right below its node, prefix for the
    commit's further lines, commit), and connector lines as (text, [], None, None).
    Lane i is drawn at column 2i."""
    lanes: list[str] = []  # the commit each lane waits for

    def row(chars: dict[int, str], width: int) -> str:
        return "".join(chars.get(i, " ") for i in range(width)).rstrip()

    for c in commits:
        if c.id not in lanes:
            lanes.append(c.id)
        col = lanes.index(c.id)
        node = row({2 * i: "*" if i == col else "|" for i in range(len(lanes))}, 2 * len(lanes))
        parents = list(dict.fromkeys(c.parents))
        extra = [p for p in parents[1:] if p not in lanes]
        after = lanes[:col] + parents[:1] + extra + lanes[col + 1 :]
        body = row({2 * i: "|" for i in range(len(after))}, 2 * len(after)) if after else ""
        opening = []
        if extra:  # a merge opens lanes to its right: "|\"
            chars = {2 * i: "|" for i in range(col + 1)}
            chars.update({2 * i - 1: "\\" for i in range(col + 1, len(after))})
            opening.append(row(chars, 2 * len(after)))
        yield node, opening, body, c
        if not parents and col < len(after):  # a root: the lanes right of it move left
            chars = {2 * i: "|" for i in range(col)}
            chars.update({2 * i + 1: "/" for i in range(col, len(after))})
            yield row(chars, 2 * len(after) + 1), [], None, None
        lanes = after
        while True:  # lanes waiting for the same commit join: "|/"
            dup = next((j for j in range(len(lanes)) if lanes[j] in lanes[:j]), None)
            if dup is None:
                break
            chars = {2 * i: "|" for i in range(dup)}
            chars.update({2 * i - 1: "/" for i in range(dup, len(lanes))})
            yield row(chars, 2 * len(lanes)), [], None, None
            del lanes[dup]


def _labels(repo: Repo) -> dict[str, list[str]]:
    labels: dict[str, list[str]] = {}
    branch, head_id = repo.head()
    if head_id:
        labels.setdefault(head_id, []).append(f"HEAD -> {branch}" if branch else "HEAD")
    for name, oid in repo.branches().items():
        if name != branch:
            labels.setdefault(oid, []).append(name)
    for name, oid in repo.tags().items():
        labels.setdefault(oid, []).append(f"tag: {name}")
    for name, oid in repo.remote_branches().items():
        labels.setdefault(oid, []).append(name)
    return labels


def _annotated_tag(repo: Repo, rev: str) -> Tag | None:
    """The annotated tag REV names (resolve prefers a branch of the same name)."""
    from ckvc.graph import branch_named

    if branch_named(repo.core, rev) is not None or rev not in repo.tags():
        return None
    return repo.tag_object(rev)


@cli.command()
@click.argument("rev", default="HEAD")
@click.option(
    "--no-data",
    is_flag=True,
    help="Commit, tag, metrics, metadata and sizes only: no tensor list (reads no state, imports no torch).",
)
@json_option
@click.pass_obj
def show(obj: Context, rev: str, no_data: bool, as_json: bool) -> None:
    """Show a commit: message, metrics, and its tensors with dtype, shape and size.
    For an annotated tag, its tagger, date and message first."""
    from ckvc import signing
    from ckvc.inspect import value_text

    repo = obj.repo
    info = repo.show(rev, tensors=not no_data)
    tag = _annotated_tag(repo, rev)
    c = info.commit
    keys = signing.TrustSettings.load(repo.core).keys()
    signature = signing.signature_summary(repo.core, c.id, trusted=keys)
    tag_signature = signing.signature_summary(repo.core, tag.id, "tag", trusted=keys) if tag is not None else None
    if as_json:
        tag_id = tag.id if tag is not None else None
        from ckvc.inspect import show_extras_json

        emit_json({**info.to_json(tag, tensors=not no_data), **show_extras_json(repo.core, c.id, tag_id)})
        return
    if tag is not None:
        signed = f"Signature: {signing.short_text(tag_signature)}\n" if tag_signature and tag_signature.signer else ""
        click.echo(f"tag {tag.name}\nTagger: {tag.tagger}\n{signed}Date:   {time_text(tag.time_ns)}\n")
        for line in tag.message.splitlines() or [""]:
            click.echo(f"    {line}".rstrip())
        click.echo("")
    click.echo(f"commit {c.id}\nAuthor: {c.author}\nDate:   {time_text(c.time_ns)}")
    if signature.status != "unsigned" or keys:
        click.echo(f"Signature: {signing.short_text(signature)}")
    if c.metrics:
        click.echo(f"Metrics: {metrics_text(c.metrics)}")
    from ckvc.notes import notes_of

    for note in notes_of(repo.core, c.id):
        click.echo(_note_line(note))
    if c.metadata:
        click.echo("Metadata: " + " ".join(f"{k}={_meta_text(v)}" for k, v in c.metadata.items()))
    unparsed = c.metadata.get("ckvc.stored_as_bytes")  # ckvc.formats.folder.UNPARSED_KEY
    if isinstance(unparsed, dict):
        for name, why in unparsed.items():
            click.echo(f"NOT PARSED, stored as bytes: {name}: {why}")
    click.echo(f"\n    {c.message or '(no message)'}\n")
    what = f"{info.blobs} blobs" if no_data else f"{len(info.tensors)} tensors"
    click.echo(f"{what}, {human_bytes(info.logical_bytes)} logical, {human_bytes(info.stored_bytes)} stored")
    echo_codecs(info.by_codec)
    if c.lossy:
        click.echo(f"LOSSY: {len(c.lossy)} tensors stored quantized (the rest exactly):")
        for path, report in c.lossy.items():
            click.echo(
                f"  {path}  {report['codec']}  max abs error {report['max_abs_error']:.3g}  "
                f"relative RMS error {report['rel_rms_error']:.3g}"
            )
    width = max((len(t.path) for t in info.tensors), default=0)
    for t in info.tensors:
        click.echo(f"  {t.path:<{width}}  {t.dtype:<10} {list(t.shape)!s:<20} {human_bytes(t.nbytes):>10}")
    if info.values:
        click.echo("values:")
        for path, value in info.values.items():
            click.echo(f"  {path or '<root>'} = {value_text(value)}")


@cli.command()
@click.argument("rev", default="HEAD")
@click.option("--metric", "metrics", multiple=True, metavar="K=V", help="A metric learned later, e.g. eval_acc=0.91.")
@click.option("--meta", "meta", multiple=True, metavar="K=V", help="A metadata string.")
@click.option("-m", "--message", default="", help="Text of the note.")
@click.option("-S/--no-sign", "--sign", "sign", default=None, help="Sign the note (default: sign_commits).")
@json_option
@click.pass_obj
def note(
    obj: Context, rev: str, metrics: tuple[str, ...], meta: tuple[str, ...], message: str, sign: bool | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Add a note to REV: metrics, metadata or text learned after the commit (an
    evaluation's result), appended, never changing the commit's id; pushed and fetched
    with it. log --best and retain --keep-best see the newest value of a metric. With
    nothing to add: list REV's notes."""
    from ckvc.cli.commit import metric_values, parse_pairs
    from ckvc.inspect import note_json

    repo = obj.repo
    if not (metrics or meta or message):
        found = repo.notes(rev)
        if as_json:
            emit_json({"commit": repo.resolve(rev), "notes": [note_json(n) for n in found]})
        else:
            for n in found:
                click.echo(_note_line(n))
        return
    added = repo.note(
        rev, metrics=metric_values(metrics), metadata=parse_pairs(meta, "--meta"), message=message, sign=sign
    )
    if as_json:
        emit_json({"commit": added.commit, **note_json(added)})
    else:
        click.echo(f"Noted on {added.commit[:12]}: {_note_line(added).split(': ', 1)[1].strip()}")


@cli.command()
@click.argument("rev", default="HEAD")
@json_option
@click.pass_obj
def manifest(obj: Context, rev: str, as_json: bool) -> None:
    """Per tensor: dtype, shape, size and a content hash from its chunk ids (no tensor
    data read; ckvc.manifest_of(state) gives the same for live tensors)."""
    entries = obj.repo.manifest(rev)
    if as_json:
        emit_json({"commit": obj.repo.resolve(rev), "tensors": [e.to_json() for e in entries]})
        return
    width = max((len(e.path) for e in entries), default=0)
    for e in entries:
        click.echo(f"{e.hash}  {e.path:<{width}}  {e.dtype:<10} {list(e.shape)!s:<20} {human_bytes(e.nbytes):>10}")


def _meta_text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def _rel(c: TensorChange) -> str:
    if c.rel_l2 is None:
        if (c.old.dtype, c.old.shape) != (c.new.dtype, c.new.shape):
            return f"{c.old.dtype}{list(c.old.shape)} -> {c.new.dtype}{list(c.new.shape)}"
        return "changed"
    return f"rel_l2={c.rel_l2:.3e} max_abs={c.max_abs:.3e}" if c.max_abs is not None else f"rel_l2={c.rel_l2:.3e}"


@cli.command()
@click.argument("a")
@click.argument("b", required=False, default=None)
@click.argument("paths", nargs=-1, metavar="[PATH...]")
@click.option("--stat", is_flag=True, help="Only the summary and which leaves changed; reads no tensor data.")
@json_option
@click.pass_obj
def diff(obj: Context, a: str, b: str | None, paths: tuple[str, ...], stat: bool, as_json: bool) -> None:
    """What changed from A to B (default HEAD): a summary line, metric changes, then
    tensors added (+), removed (-) and changed (~, largest relative L2 change first),
    and non-tensor values. PATHs (after B: ckvc diff A HEAD model) limit it to leaves equal to,
    under ("model", "optimizer.state") or matching a glob ("*.bias"). RNG states
    (which change every step) are one line."""
    from ckvc.inspect import value_text

    d = obj.repo.diff(a, "HEAD" if b is None else b, paths, data=not stat)  # "" is no revision
    if as_json:
        emit_json(d.to_json())
        return
    click.echo(_diff_summary(d))
    for name, old, new in d.metrics_changed:
        click.echo(f"metric {name}: {_num(old)} -> {_num(new)}")
    if d.rng_changed:
        n = len(d.rng_changed)
        click.echo(f"rng: {n} RNG state {'leaf' if n == 1 else 'leaves'} changed (expected between steps)")
    for path in d.added:
        click.echo(f"+ {path}")
    for path in d.removed:
        click.echo(f"- {path}")
    for c in d.changed:
        click.echo(
            f"~ {c.path}" if stat and c.rel_l2 is None and c.old.shape == c.new.shape else f"~ {c.path}  {_rel(c)}"
        )
    for path, old, new in d.values_changed:
        click.echo(f"~ {path}  {value_text(old, 60)} -> {value_text(new, 60)}")


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _num(v: float | None) -> str:
    return "(none)" if v is None else f"{v:.6g}"


def _diff_summary(d: StateDiff) -> str:
    if not (d.added or d.removed or d.changed or d.values_changed or d.rng_changed or d.metrics_changed):
        return f"no differences ({d.unchanged} tensors identical)"
    parts = [
        f"{_count(len(d.changed), 'tensor')} changed ({human_bytes(d.changed_bytes)})",
        f"{len(d.added)} added ({human_bytes(d.added_bytes)})",
        f"{len(d.removed)} removed ({human_bytes(d.removed_bytes)})",
        f"{d.unchanged} unchanged",
    ]
    if d.values_changed:
        parts.append(f"{_count(len(d.values_changed), 'value')} changed")
    if d.metrics_changed:
        parts.append(f"{_count(len(d.metrics_changed), 'metric')} changed")
    return ", ".join(parts)


class _ShowByDefault(click.Group):
    """``ckvc reflog [REF]`` shows, as before; ``ckvc reflog expire ...`` expires
    (git's reflog show / expire): a first word that is no subcommand is a REF."""

    command_class = JsonErrorCommand

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("-h", "--help")):
            args = ["show", *args]
        return super().parse_args(ctx, args)


@cli.group(cls=_ShowByDefault)
def reflog() -> None:
    """Every move of a ref (``reflog [show] [REF]``), or drop old entries (``reflog expire``)."""


@reflog.command("expire")
@click.option("--all", "all_refs", is_flag=True, help="Every reflog (else the REFs given).")
@click.option(
    "--expire", "age", default=None, metavar="AGE",
    help="Drop entries older than AGE: now, 30d, 12h (default: the config's reflog_expiry).",
)  # fmt: skip
@click.argument("refs", nargs=-1)
@json_option
@click.pass_obj
def reflog_expire(obj: Context, all_refs: bool, age: str | None, refs: tuple[str, ...], as_json: bool) -> None:
    """Drop reflog entries older than AGE, so that `ckvc gc` may free the commits
    only they kept (a deleted branch's, say); git reflog expire."""
    from ckvc.retention_policy import parse_duration

    if all_refs == bool(refs):
        raise InvalidInputError("reflog expire needs --all or REF names (not both)")
    seconds = None if age is None else 0.0 if age == "now" else parse_duration(age)
    dropped = obj.repo.expire_reflogs(seconds, None if all_refs else list(refs))
    if as_json:
        emit_json({"dropped": dropped})
    else:
        click.echo(f"dropped {dropped} reflog entr{'y' if dropped == 1 else 'ies'}")


@reflog.command("show")
@click.argument("ref", default="HEAD")
@json_option
@click.pass_obj
def reflog_show(obj: Context, ref: str, as_json: bool) -> None:
    """Every move of REF (default HEAD), newest first."""
    entries = obj.repo.reflog(ref)
    if as_json:
        emit_json([{"old": e.old, "new": e.new, "time": time_text(e.time_ns), "message": e.message} for e in entries])
        return
    for i, e in enumerate(entries):
        click.echo(f"{(e.new or '0' * 12)[:12]} {ref}@{{{i}}}: {e.message}  ({time_text(e.time_ns)})")


@cli.command()
@json_option
@click.pass_obj
def status(obj: Context, as_json: bool) -> None:
    """Where HEAD is, and whether the remote holds it: "backed up" only when the
    remote's branch (as last pushed, fetched or committed to) holds HEAD's commit."""
    branch_name, commit_id = obj.repo.head()
    state = obj.repo.status()
    backlog = state.backlog
    from ckvc.scrub import SCRUB_FILE, scrub_status

    scrubbed = scrub_status(obj.repo.core.local_dir / SCRUB_FILE, len(obj.repo.store.packs()))
    if as_json:
        emit_json({**state.to_json(), "branch": branch_name, "commit": commit_id, "scrub": scrubbed})
        return
    if commit_id is None:
        click.echo(f"On branch {branch_name}, no commits yet")
    else:
        click.echo(f"On branch {branch_name}" if branch_name else "HEAD detached")
        click.echo(f"at {commit_id}")
    remote = state.remote
    if remote is not None and state.backed_up is not None:
        tracked = f"{remote}/{state.branch}"
        if state.backed_up:
            click.echo(f"backed up to {remote} ({tracked} holds it)")
        else:
            assert state.not_backed_up is not None
            click.echo(
                f"not backed up to {remote}: {state.ahead} commit(s) not on {tracked}, "
                f"the newest {state.not_backed_up[:12]}"
            )
        if state.behind:
            click.echo(f"behind {tracked} by {state.behind} commit(s)")
    for t in state.tracking:
        if t.remote == remote:
            continue  # said above
        where = f"{t.remote}/{state.branch}"
        if t.ahead and t.behind:
            click.echo(f"diverged from {where}: {t.ahead} commit(s) here, {t.behind} there")
        elif t.ahead or t.behind:
            click.echo(f"{'ahead of' if t.ahead else 'behind'} {where} by {t.ahead or t.behind} commit(s)")
        else:
            click.echo(f"up to date with {where}")
    last = scrubbed["last_complete"]
    if last is not None or scrubbed["verified_packs"]:
        done = f"last complete cycle {time_text(last['finished_ns'])}" if last else "no cycle complete yet"
        coverage = scrubbed["coverage"] or 0.0
        click.echo(f"scrub: {done}; current cycle {coverage:.0%} done")
    for pack, problem in scrubbed["damage"].items():
        click.echo(f"scrub found damage in {pack}: {problem} (ckvc fsck --repair)")
    if backlog is not None and backlog.entries:
        refs = ", ".join(dict.fromkeys(e.ref.removeprefix("refs/heads/") for e in backlog.entries))
        click.echo(f"auto_push to {backlog.remote}: {len(backlog.entries)} commit(s) queued on {refs}")
        if backlog.last_error:
            click.echo(f"  last attempt failed ({backlog.failures}x): {backlog.last_error}; retrying")
