"""The ``ckvc`` command line. Parses arguments, calls Repo, renders text or --json.

Exit codes: 0 success; 1 fsck found damage; 2 usage error (click);
3 and up: one per error class (see ckvc.errors, ``exit_code``). A user error
prints one line on stderr, never a traceback.

Over 600 lines on purpose, for now: one module holds the click group, the error
rendering shared by every command and the commands themselves (each a thin
parse-call-render over Repo), so ``ckvc --help`` imports one module and no torch.
Splitting it (history, refs, maintenance, import) needs its shared helpers made
public first; that is a follow-up, not part of issue 14's facade work.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ckvc.errors import CkvcError, InvalidInputError

# Only click and ckvc.errors load up front: --help, log, status, branch, tag,
# reflog, config and du never import torch (1.5 s). Commands that read or write
# tensors import ckvc.files / ckvc.state / torch in their own bodies;
# tests/cli/test_cli_startup.py checks this in a fresh interpreter.
if TYPE_CHECKING:
    from ckvc.inspect import CodecUsage, StateDiff, TensorChange
    from ckvc.objects import Commit, Tag
    from ckvc.repo import Repo

FSCK_DAMAGE_EXIT = 1


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _time(ns: int) -> str:
    from ckvc.inspect import time_text

    return time_text(ns)


def _warn(text: str) -> None:
    """A warning: one line on stderr, also under --json (stdout holds only results)."""
    click.echo(f"ckvc: warning: {text}", err=True)


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


def _metrics_text(metrics: Any) -> str:
    return " ".join(f"{k}={v:.6g}" for k, v in metrics.items())


@contextmanager
def _progress_bar(label: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A tqdm bar with byte rates on stderr; off for --json and when stderr is not a terminal."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    bar = tqdm(desc=label, unit="B", unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr)

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    try:
        yield update
    finally:
        bar.close()


class Context:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._repo: Repo | None = None

    @property
    def repo(self) -> Repo:
        if self._repo is None:
            from ckvc.repo import Repo

            self._repo = Repo.open(self.directory)
        return self._repo

    def close(self) -> None:
        if self._repo is not None:
            self._repo.close()


class JsonErrorCommand(click.Command):
    """Under ``--json`` a CkvcError is one JSON object on stderr, ``{"error": {"type",
    "message", "exit_code"}}``, with the same exit code as the plain one-line message
    (stdout then stays empty: it only ever holds results)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CkvcError as exc:
            if not ctx.params.get("as_json"):
                raise
            error = {"type": type(exc).__name__, "message": str(exc), "exit_code": exc.exit_code}
            click.echo(json.dumps({"error": error}), err=True)
            ctx.exit(exc.exit_code)


class CkvcGroup(click.Group):
    """Turns every error into one line on stderr and its exit code (``_exit_code_for``)."""

    command_class = JsonErrorCommand

    def invoke(self, ctx: click.Context) -> Any:
        from ckvc.errors import CkvcWarning

        try:
            with warnings.catch_warnings():
                # Each distinct ckvc warning once per command, as one line (_show_warning).
                warnings.simplefilter("always", CkvcWarning)
                printed: set[str] = set()
                warnings.showwarning = functools.partial(_show_warning, printed)
                return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except BaseException as exc:
            if isinstance(exc, SystemExit):
                raise
            ctx.exit(_exit_code_for(exc, ctx.invoked_subcommand))


DEBUG_ENV = "CKVC_DEBUG"


def _exit_code_for(exc: BaseException, command: str | None) -> int:
    """Print one line for ``exc`` and return the exit code: a CkvcError's own; an
    OSError or lmdb error as the typed StorageError it maps to; Ctrl-C 130; any
    other exception (a bug) UnexpectedError's 70, with the traceback only when
    $CKVC_DEBUG is set."""
    from ckvc.errors import InterruptedOperationError, UnexpectedError, is_storage_exception, storage_error

    what = f"ckvc {command}" if command else "ckvc"
    original = exc
    if isinstance(exc, InterruptedOperationError) and exc.landed:
        click.echo(f"ckvc: {exc}", err=True)  # it took effect: a success, said plainly
        return 0
    if isinstance(exc, KeyboardInterrupt) and not isinstance(exc, CkvcError):
        exc = InterruptedOperationError(f"interrupted: {what} did not finish")
    elif not isinstance(exc, CkvcError) and is_storage_exception(exc):
        exc = storage_error(exc, f"running {what}", f"{what} did not finish")
    if os.environ.get(DEBUG_ENV):
        traceback.print_exception(original)
    if isinstance(exc, CkvcError):
        click.echo(f"ckvc: error: {exc}", err=True)
        return exc.exit_code
    first = (str(exc).splitlines() or [""])[0]
    hint = "" if os.environ.get(DEBUG_ENV) else f" (set {DEBUG_ENV}=1 for a traceback)"
    click.echo(f"ckvc: internal error: {type(exc).__name__}: {first}{hint}", err=True)
    return UnexpectedError.exit_code


def _show_warning(
    printed: set[str],
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """ckvc's warnings as one line on stderr, each text once; others as Python prints them."""
    from ckvc.errors import CkvcWarning

    if issubclass(category, CkvcWarning):
        if str(message) not in printed:
            printed.add(str(message))
            click.echo(f"ckvc: warning: {message}", err=True)
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import version

    from ckvc.codecs import planes  # numpy: loaded only when asked

    native = "built" if planes.native() is not None else "not built, numpy fallback 3-10x slower"
    click.echo(f"{ctx.find_root().info_name} {version('ckvc')} (native codec loops: {native})")
    ctx.exit()


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.group(cls=CkvcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-C", "directory", default=".", metavar="DIR", help="Run as if started in DIR (like git -C).")
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_version,
    help="Show the version and whether the native codec loops are built, then exit.",
)
@click.pass_context
def cli(ctx: click.Context, directory: str) -> None:
    """ckvc: version control for deep-learning checkpoints."""
    if not Path(directory).is_dir():
        raise InvalidInputError(f"cannot change to {directory}: not a directory")
    obj = Context(directory)
    ctx.obj = obj
    ctx.call_on_close(obj.close)


@cli.command()
@click.argument("directory", required=False, default=None)
@click.option("--chunk-size", type=int, default=None, help="Chunk size in bytes (default 4 MiB).")
@click.option("--default-branch", default="main", show_default=True)
@json_option
@click.pass_obj
def init(obj: Context, directory: str | None, chunk_size: int | None, default_branch: str, as_json: bool) -> None:
    """Create a repository in DIRECTORY (default: the current one). On an existing
    repository, like git: it is opened (checked) and left as it is, exit 0."""
    from ckvc.core import REPO_DIR
    from ckvc.repo import Repo

    path = Path(obj.directory, directory) if directory else Path(obj.directory)
    existing = (path / REPO_DIR / "config.json").is_file()
    if existing:
        repo = Repo.open(path)  # refuses a damaged or too new repository
        if chunk_size is not None and chunk_size != repo.config.chunk_size:
            repo.close()
            raise InvalidInputError(
                f"{repo.dir} exists with chunk size {repo.config.chunk_size}; --chunk-size cannot change it"
            )
    else:
        repo = Repo.init(path, chunk_size=chunk_size, default_branch=default_branch)
    repo.close()
    if as_json:
        _emit_json({"path": str(repo.dir), "reinitialized": existing})
    elif existing:
        click.echo(f"Reinitialized existing ckvc repository in {repo.dir}")
    else:
        click.echo(f"Initialized empty ckvc repository in {repo.dir}")


def _parse_pairs(pairs: tuple[str, ...], what: str) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidInputError(f"{what} must look like key=value, got {pair!r}")
        out[key] = value
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
    help="Opt-in lossy storage: a preset (optimizer-q8, optimizer-q4, compact-q4) or e.g. 'optimizer.*=q4'.",
)
@click.option("--follow-links", is_flag=True, help="Store what symlinks leaving the directory point to.")
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
    as_json: bool,
) -> None:
    """Commit a checkpoint: a torch.save file, a .safetensors file, or a directory of them."""
    metric_values: dict[str, float] = {}
    for key, value in _parse_pairs(metrics, "--metric").items():
        try:
            metric_values[key] = float(value)
        except ValueError:
            raise InvalidInputError(f"metric {key!r} is not a number: {value!r}") from None
    repo = obj.repo
    if not path.is_absolute():
        path = Path(obj.directory) / path
    from ckvc.files import read_checkpoint

    with _progress_bar("read", not as_json) as progress:
        state, source_meta = read_checkpoint(path, follow_links=follow_links, progress=progress)
    metadata = {**source_meta, **_parse_pairs(meta, "--meta")}
    lossy_spec: str | dict[str, str] | None = None
    if len(lossy) == 1 and "=" not in lossy[0]:
        lossy_spec = lossy[0]
    elif lossy:
        lossy_spec = _parse_pairs(lossy, "--lossy")
    with _progress_bar("commit", not as_json) as progress:
        commit_id = repo.commit(
            state, message=message, metrics=metric_values, metadata=metadata, progress=progress, lossy=lossy_spec
        )
    stats = repo.last_commit_stats
    assert stats is not None
    branch, _ = repo.head()
    if branch is None:
        _warn(
            f"committed on a detached HEAD: {commit_id[:12]} is on no branch and only the reflog keeps it; "
            f"to keep it: ckvc branch NAME {commit_id[:12]}"
        )
    if as_json:
        _emit_json(
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
    as_json: bool,
) -> None:
    """Show the commits reachable from REV, newest first, with their metrics."""
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
    if as_json:
        from ckvc.inspect import log_json

        _emit_json(log_json(commits, pruned))
        return
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
        if oneline:
            metrics = f"  [{_metrics_text(c.metrics)}]" if c.metrics else ""
            click.echo(f"{lead}{c.id[:12]}{deco}{mark} {first_line}{metrics}")
            for line in opening:
                click.echo(line)
            continue
        lines = [f"commit {c.id}{deco}{mark}"]
        if c.id in pruned:
            lines.append(f"Pruned: {_time(pruned[c.id].time_ns)} by [{pruned[c.id].policy}]")
        if len(c.parents) > 1:
            lines.append("Merge:  " + " ".join(p[:12] for p in c.parents))
        lines += [f"Author: {c.author}", f"Date:   {_time(c.time_ns)}"]
        if c.metrics:
            lines.append(f"Metrics: {_metrics_text(c.metrics)}")
        lines.append("")
        lines += [f"    {line}" for line in (c.message or "(no message)").splitlines()]
        lines.append("")
        click.echo(lead + lines[0])
        for line in opening:
            click.echo(line)
        for line in lines[1:]:
            click.echo((cont + line).rstrip() if cont else line)


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
    repo = obj.repo
    info = repo.show(rev, tensors=not no_data)
    tag = _annotated_tag(repo, rev)
    c = info.commit
    if as_json:
        _emit_json(info.to_json(tag, tensors=not no_data))
        return
    if tag is not None:
        click.echo(f"tag {tag.name}\nTagger: {tag.tagger}\nDate:   {_time(tag.time_ns)}\n")
        for line in tag.message.splitlines() or [""]:
            click.echo(f"    {line}".rstrip())
        click.echo("")
    click.echo(f"commit {c.id}\nAuthor: {c.author}\nDate:   {_time(c.time_ns)}")
    if c.metrics:
        click.echo(f"Metrics: {_metrics_text(c.metrics)}")
    if c.metadata:
        click.echo("Metadata: " + " ".join(f"{k}={_meta_text(v)}" for k, v in c.metadata.items()))
    click.echo(f"\n    {c.message or '(no message)'}\n")
    what = f"{info.blobs} blobs" if no_data else f"{len(info.tensors)} tensors"
    click.echo(f"{what}, {human_bytes(info.logical_bytes)} logical, {human_bytes(info.stored_bytes)} stored")
    _echo_codecs(info.by_codec)
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
            click.echo(f"  {path or '<root>'} = {value!r:.100}")


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
    d = obj.repo.diff(a, "HEAD" if b is None else b, paths, data=not stat)  # "" is no revision
    if as_json:
        _emit_json(d.to_json())
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
        click.echo(f"~ {path}  {old!r:.60} -> {new!r:.60}")


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
        from ckvc.files import export_commit
        from ckvc.storage.files import require_writable

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
            with _progress_bar("checkout", not as_json) as progress:
                written = export_commit(repo, rev, output, progress=progress)
        if read_only:
            # What the caller can have from a repository it cannot write: the files.
            _warn(f"the repository is read-only: HEAD was not moved (ckvc export {rev} OUT says so up front)")
            if as_json:
                _emit_json(
                    {"commit": repo.resolve(rev), "branch": repo.head()[0], "written": [str(p) for p in written]}
                )
            else:
                for p in written:
                    click.echo(f"wrote {p}")
            return
    commit_id = repo.switch(rev, new_branch=new_branch)
    branch, _ = repo.head()
    if branch is None and was_branch is not None:
        _warn(
            f"HEAD is now detached at {commit_id[:12]} (it was on branch '{was_branch}'); new commits will be on "
            f"no branch. To write a commit without moving HEAD: ckvc export {rev} OUT; to go back: ckvc switch "
            f"{was_branch}; to branch here: ckvc switch -c NAME"
        )
    if as_json:
        _emit_json({"commit": commit_id, "branch": branch, "written": [str(p) for p in written]})
        return
    where = f"branch '{branch}'" if branch else f"detached HEAD at {commit_id[:12]}"
    click.echo(f"Switched to {'a new ' if new_branch else ''}{where}")
    for p in written:
        click.echo(f"wrote {p}")


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
        _emit_json({"commit": commit_id, "branch": name, "created": create})
    else:
        click.echo(f"Switched to {'a new ' if create else ''}branch '{name}'")


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
    type=click.Choice(["pt", "safetensors", "dir"]),
    default=None,
    help="Output kind (default: the commit's own kind, else OUTPUT's suffix).",
)
@json_option
@click.pass_obj
def export(obj: Context, rev: str, output: Path, prefix: str | None, fmt: str | None, as_json: bool) -> None:
    """Write commit REV to OUTPUT without moving HEAD: e.g. the weights alone of a
    training state as one file, ckvc export HEAD model.safetensors --prefix model."""
    from ckvc.files import export_commit

    repo = obj.repo
    if not output.is_absolute():
        output = Path(obj.directory) / output
    if prefix is not None and not prefix.endswith("."):
        prefix += "."  # "model" means the leaves under model
    if fmt is None and prefix is None and _is_dcp(repo, rev):
        written = _export_dcp(repo, rev, output)
    else:
        with _progress_bar("export", not as_json) as progress:
            written = export_commit(repo, rev, output, format=fmt, prefix=prefix, progress=progress)  # type: ignore[arg-type]
    commit_id = repo.resolve(rev)
    if as_json:
        _emit_json({"commit": commit_id, "written": [str(p) for p in written]})
        return
    for p in written:
        click.echo(f"wrote {p}")


@cli.command()
@click.option("-d", "--delete", is_flag=True, help="Delete the branch NAME.")
@click.option("-a", "--all", "all_branches", is_flag=True, help="Also list remote-tracking branches.")
@click.argument("name", required=False)
@click.argument("rev", required=False, default="HEAD")
@json_option
@click.pass_obj
def branch(obj: Context, delete: bool, all_branches: bool, name: str | None, rev: str, as_json: bool) -> None:
    """List branches (with -a remote-tracking ones too), create NAME at REV, or delete NAME with -d."""
    repo = obj.repo
    if name is None:
        if delete:
            raise InvalidInputError("branch -d needs a NAME")
        current, _ = repo.head()
        branches = repo.branches()
        remotes = repo.remote_branches() if all_branches else {}
        if as_json:
            _emit_json({"current": current, "branches": branches, **({"remotes": remotes} if all_branches else {})})
        else:
            for n, oid in branches.items():
                click.echo(f"{'*' if n == current else ' '} {n:<20} {oid[:12]}")
            for n, oid in remotes.items():
                click.echo(f"  {'remotes/' + n:<20} {oid[:12]}")
        return
    if delete:
        oid = repo.delete_branch(name)
        _done(as_json, {"deleted": name, "was": oid}, f"Deleted branch {name} (was {oid[:12]})")
    else:
        oid = repo.branch(name, rev)
        _done(as_json, {"created": name, "commit": oid}, f"Created branch {name} at {oid[:12]}")


@cli.command()
@click.option("-d", "--delete", is_flag=True, help="Delete the tag NAME.")
@click.option("-m", "--message", default=None, help="Make an annotated tag with this message.")
@click.option("-n", "lines", is_flag=True, help="List tags with the first line of their message.")
@click.argument("name", required=False)
@click.argument("rev", required=False, default="HEAD")
@json_option
@click.pass_obj
def tag(
    obj: Context, delete: bool, message: str | None, lines: bool, name: str | None, rev: str, as_json: bool
) -> None:
    """List tags (with -n, each with the first line of its message), create NAME at
    REV (annotated with -m), or delete NAME with -d."""
    repo = obj.repo
    if name is None:
        if delete:
            raise InvalidInputError("tag -d needs a NAME")
        tags = repo.tags()
        if not lines:
            if as_json:
                _emit_json(tags)
            else:
                for n, oid in tags.items():
                    click.echo(f"{n:<20} {oid[:12]}")
            return
        # like git tag -n: an annotated tag's message, else its commit's
        annotated = {n: repo.tag_object(n) for n in tags}
        texts = {n: t.message if t is not None else repo.read_commit(tags[n]).message for n, t in annotated.items()}
        if as_json:
            _emit_json(
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
        oid = repo.tag(name, rev, message)
        _done(as_json, {"created": name, "target": oid}, f"Created tag {name} at {repo.resolve(name)[:12]}")


def _duration_text(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _done(as_json: bool, payload: dict[str, Any], text: str) -> None:
    if as_json:
        _emit_json(payload)
    else:
        click.echo(text)


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
@click.option("--remote", "remote_name", default=None, metavar="NAME", help="Check remote NAME instead.")
@json_option
@click.pass_obj
def fsck(
    obj: Context,
    rebuild_index: bool,
    level: str,
    full_flag: bool,
    sample: str | None,
    remote_name: str | None,
    as_json: bool,
) -> None:
    """Verify the refs, the commit graph and every stored byte against its hash.
    Exits 1 and names each damaged object when anything is wrong."""
    fraction = _parse_fraction(sample)
    if full_flag:
        level = "full"
    elif fraction is not None and level == "full":
        level = "metadata"  # the sample replaces the full read
    if remote_name is not None and rebuild_index:
        raise InvalidInputError("--rebuild-index checks the local index; a remote has none (its catalog is rebuilt)")
    with _progress_bar("fsck", not as_json) as progress:
        if remote_name is not None:
            report = obj.repo.fsck_remote(remote_name, level=level, sample=fraction, progress=progress)
        else:
            report = obj.repo.fsck(rebuild_index=rebuild_index, level=level, sample=fraction, progress=progress)
    if as_json:
        _emit_json(report.to_json())
    else:
        if report.rebuilt_index:
            click.echo("index rebuilt from packs")
        click.echo(
            f"checked {report.objects_checked} objects ({human_bytes(report.bytes_checked)}) in "
            f"{report.packs_checked} packs; {report.commits_reachable} reachable commits"
        )
        for p in report.problems:
            click.echo(f"{p.severity}: {p.kind}: {p.object_id or '-'}: {p.detail}")
        click.echo("ok" if report.ok else f"DAMAGED: {len(report.damaged_objects())} objects")
    if not report.ok:
        sys.exit(FSCK_DAMAGE_EXIT)


def _echo_codecs(by_codec: Mapping[str, CodecUsage]) -> None:
    """Stored bytes per codec: where the space goes, and how well each codec does."""
    if not by_codec:
        return
    click.echo("by codec:          raw / stored (distinct chunks)")
    for name, c in by_codec.items():
        click.echo(
            f"  {name:<16} {human_bytes(c.raw_bytes):>10} / {human_bytes(c.stored_bytes):>10}  "
            f"{c.ratio:6.3f} of raw  {c.chunks} chunks"
        )


@cli.command()
@json_option
@click.pass_obj
def du(obj: Context, as_json: bool) -> None:
    """Logical vs stored bytes, dedup and compression ratios, unique bytes per commit."""
    usage = obj.repo.du()
    if as_json:
        _emit_json(usage.to_json())
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
    _echo_codecs(usage.by_codec)
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
@click.option("--branch", "branches", multiple=True, metavar="B", help="Only prune on these branches.")
@click.option("--auto/--no-auto", default=None, help="Apply the stored policy after every commit.")
@click.option("--dry-run", is_flag=True, help="Show what would be released and why the rest is kept.")
@json_option
@click.pass_obj
def retain(
    obj: Context,
    keep_last: int | None,
    keep_best: tuple[str, ...],
    keep_every: int | None,
    keep_within: str | None,
    branches: tuple[str, ...],
    auto: bool | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Apply a retention policy: commits no rule keeps are pruned (history and
    metrics stay; `ckvc gc` frees their data once their packs are older than the
    gc_grace period, `ckvc gc --now` at once). Rules given here are stored as the
    repository's policy; with none, the stored policy is used."""
    from ckvc.retention_policy import KeepBest, RetentionPolicy, parse_duration

    repo = obj.repo
    stored = repo.retention_policy()
    if keep_last or keep_best or keep_every or keep_within:
        policy = RetentionPolicy(
            keep_last=keep_last,
            keep_best=tuple(KeepBest.parse(b) for b in keep_best),
            keep_every=keep_every,
            keep_within_s=parse_duration(keep_within) if keep_within else None,
            branches=branches or None,
            auto=bool(auto) if auto is not None else bool(stored and stored.auto),
        )
    elif stored is not None:
        policy = stored
        if branches or auto is not None:
            policy = dataclasses.replace(
                policy, branches=branches or policy.branches, auto=policy.auto if auto is None else auto
            )
    else:
        raise InvalidInputError("no retention policy stored; give rules, e.g. ckvc retain --keep-last 3")
    plan = repo.retain(policy, dry_run=dry_run)
    if not dry_run and policy != stored:
        repo.set_retention(policy)
    if as_json:
        _emit_json({**plan.to_json(), "dry_run": dry_run})
        return
    click.echo(f"policy: {policy.describe()}{' (auto)' if policy.auto else ''}")
    verb = "would release" if dry_run else "released"
    click.echo(
        f"{verb} {len(plan.released)} commits; keeping {len(plan.kept)}; {len(plan.already_pruned)} pruned before"
    )
    messages = {c.id: c for name in repo.branches() for c in repo.log(name)}
    for cid, reasons in plan.kept.items():
        msg = messages[cid].message.splitlines()[0] if cid in messages and messages[cid].message else ""
        click.echo(f"  keep    {cid[:12]}  {msg:<24.24} {'; '.join(reasons)}")
    for cid in plan.released:
        msg = messages[cid].message.splitlines()[0] if cid in messages and messages[cid].message else ""
        click.echo(f"  release {cid[:12]}  {msg}")
    if not dry_run and plan.released:
        grace = _duration_text(repo.config.gc_grace_s)
        click.echo(
            f"their data is freed by `ckvc gc`, except packs written in the last {grace} (gc_grace), "
            "which gc keeps for concurrent writers; `ckvc gc --now` frees those too "
            "(only when nothing else is writing to this repository)"
        )


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
    from ckvc.retention_policy import parse_duration

    if remote is not None:
        done = obj.repo.gc_remote(remote, dry_run=dry_run, now=now, grace_s=parse_duration(grace) if grace else None)
        if as_json:
            _emit_json(done.to_json())
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
        _emit_json(report.to_json())
        return
    plan = report.plan
    click.echo(
        f"live: {plan.live_objects} objects, {human_bytes(plan.live_bytes)}; "
        f"reclaimable: {human_bytes(plan.reclaimable_bytes)} "
        f"({plan.count('delete')} packs to delete, {plan.count('repack')} to repack, "
        f"{plan.count('young')} in the grace period)"
    )
    if report.executed:
        click.echo(
            f"freed {human_bytes(report.bytes_freed)}: {report.packs_deleted} packs deleted, "
            f"{report.packs_repacked} repacked into {report.packs_written}, in {report.seconds:.2f} s "
            f"(writers blocked {report.critical_section_s * 1000:.0f} ms)"
        )
        if report.kept_revived:
            click.echo(f"{len(report.kept_revived)} packs kept: a concurrent commit needs them")


@cli.command("config")
@click.argument("key", required=False)
@click.argument("value", required=False)
@json_option
@click.pass_obj
def config_cmd(obj: Context, key: str | None, value: str | None, as_json: bool) -> None:
    """Show the repository config, or set reflog_expiry (e.g. 30d), gc_grace (e.g. 1h),
    repack_threshold (0..1), keyframe_interval (1..255; 1 turns deltas off), codec
    (auto, zstd, raw; zstd:LEVEL), cache_size (e.g. 50GiB, unlimited) or auto_push
    (a remote, none)."""
    from ckvc.retention_policy import parse_duration

    repo = obj.repo
    if key is not None:
        if value is None:
            raise InvalidInputError(f"give a value for {key}")
        if key in ("reflog_expiry", "gc_grace"):
            repo.set_config(**{f"{key}_s": parse_duration(value)})
        elif key == "repack_threshold":
            try:
                repo.set_config(repack_threshold=float(value))
            except ValueError:
                raise InvalidInputError(f"repack_threshold must be a number, got {value!r}") from None
        elif key == "keyframe_interval":
            try:
                interval = int(value)
            except ValueError:
                raise InvalidInputError(f"keyframe_interval must be an integer, got {value!r}") from None
            repo.set_config(keyframe_interval=interval)
        elif key in ("cache_size", "auto_push"):
            repo.set_config(**{key: value})
        elif key == "codec":
            name, _, level = value.partition(":")
            try:
                codec: dict[str, Any] = {"name": name, **({"level": int(level)} if level else {})}
            except ValueError:
                raise InvalidInputError(f"codec level must be an integer, got {level!r}") from None
            if name == "raw" and level:
                raise InvalidInputError("the raw codec takes no level")
            repo.set_config(codec=codec)
        else:
            raise InvalidInputError(
                f"unknown setting {key!r}; settable: "
                "reflog_expiry, gc_grace, repack_threshold, keyframe_interval, codec, cache_size, auto_push"
            )
    data = dataclasses.asdict(repo.config)
    from ckvc.remote.lazy import HybridSettings

    hybrid = HybridSettings.load(repo.core)
    data.update(cache_size=hybrid.cache_size, auto_push=hybrid.auto_push, lazy=hybrid.lazy)
    if as_json:
        _emit_json(data)
    else:
        for k, v in sorted(data.items()):
            click.echo(f"{k} = {json.dumps(v)}")


@cli.command()
@click.argument("ref", default="HEAD")
@json_option
@click.pass_obj
def reflog(obj: Context, ref: str, as_json: bool) -> None:
    """Every move of REF (default HEAD), newest first."""
    entries = obj.repo.reflog(ref)
    if as_json:
        _emit_json([{"old": e.old, "new": e.new, "time": _time(e.time_ns), "message": e.message} for e in entries])
        return
    for i, e in enumerate(entries):
        click.echo(f"{(e.new or '0' * 12)[:12]} {ref}@{{{i}}}: {e.message}  ({_time(e.time_ns)})")


@cli.command()
@json_option
@click.pass_obj
def status(obj: Context, as_json: bool) -> None:
    """Where HEAD is, and (auto_push) what is not backed up yet."""
    branch_name, commit_id = obj.repo.head()
    backlog = obj.repo.backup_status()
    if as_json:
        out: dict[str, Any] = {"branch": branch_name, "commit": commit_id}
        if backlog is not None:
            out["backup"] = backlog.to_json()
        _emit_json(out)
        return
    if commit_id is None:
        click.echo(f"On branch {branch_name}, no commits yet")
    else:
        click.echo(f"On branch {branch_name}" if branch_name else "HEAD detached")
        click.echo(f"at {commit_id}")
    if backlog is not None:
        if not backlog.entries:
            click.echo(f"backed up to {backlog.remote} (auto_push)")
        else:
            refs = ", ".join(dict.fromkeys(e.ref.removeprefix("refs/heads/") for e in backlog.entries))
            click.echo(f"not backed up to {backlog.remote}: {len(backlog.entries)} commit(s) on {refs}")
            if backlog.last_error:
                click.echo(f"  last attempt failed ({backlog.failures}x): {backlog.last_error}; retrying")


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
    with _progress_bar("import", not as_json and not dry_run) as progress:
        result = import_checkpoints(obj.repo, source, branch=branch, glob=glob, dry_run=dry_run, progress=progress)
    if as_json:
        _emit_json(result.to_json())
        return
    plan = result.plan
    for name, reason in plan.skipped:
        click.echo(f"skipped {name}: {reason}")
    for c in plan.checkpoints:
        if c.name in plan.done:
            click.echo(f"already imported as {plan.done[c.name][:12]}: {c.message}")
            continue
        head = "would commit:" if dry_run else f"[{plan.branch} {result.imported[c.name][:12]}]"
        metrics = f"  [{_metrics_text(c.metrics)}]" if c.metrics else ""
        click.echo(f"{head} {c.message}  {_time(c.time_ns)}{metrics}")
    verb = "would import" if dry_run else "imported"
    click.echo(
        f"{verb} {len(plan.todo)} of {len(plan.checkpoints)} checkpoints onto branch {plan.branch}"
        + (f" ({len(plan.done)} already there)" if plan.done else "")
    )


from ckvc.cli import remote as remote_commands  # noqa: E402  (registered once the group and helpers exist)

remote_commands.register(cli, remote_commands.CliTools(_progress_bar, _emit_json, human_bytes, json_option))
from ckvc.cli import cache as cache_commands  # noqa: E402

cache_commands.register(cli, remote_commands.CliTools(_progress_bar, _emit_json, human_bytes, json_option))

from ckvc.cli import serve as serve_command  # noqa: E402

serve_command.register(cli)

_quiet_shutdown_registered: list[bool] = []


def main() -> None:
    """The ``ckvc`` entry point: no error leaves it as a traceback (``_exit_code_for``);
    errors after a command returns (closing the repository) are mapped too."""
    warnings.showwarning = functools.partial(_show_warning, set())
    try:
        # Not click's standalone mode: it turns a Ctrl-C outside the command body
        # (closing the repository, writing the last line) into "Aborted!" and exit 1.
        code = cli.main(prog_name="ckvc", standalone_mode=False)
    except SystemExit:
        raise
    except click.ClickException as exc:  # usage errors: click's own message, exit 2
        exc.show()
        code = exc.exit_code
    except click.exceptions.Abort as exc:
        code = _exit_code_for(
            exc.__cause__ if isinstance(exc.__cause__, KeyboardInterrupt) else KeyboardInterrupt(), None
        )
    except BaseException as exc:
        code = _exit_code_for(exc, None)
    finally:
        # Once the outcome is decided and said, a Ctrl-C during interpreter
        # shutdown (library finalizers run after atexit) must not add a traceback.
        if not _quiet_shutdown_registered:
            atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
            _quiet_shutdown_registered.append(True)
    sys.exit(code if isinstance(code, int) else 0)
