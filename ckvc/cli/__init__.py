"""The ``ckvc`` command line. Parses arguments, calls Repo, renders text or --json.

Exit codes: 0 success; 1 fsck found damage; 2 usage error (click);
3 and up: one per error class (see ckvc.errors, ``exit_code``). A user error
prints one line on stderr, never a traceback.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import numpy as np

from ckvc.cli.files import read_checkpoint, write_checkpoint
from ckvc.errors import CkvcError, InvalidInputError
from ckvc.objects import Commit
from ckvc.repo import Repo, TensorSummary

FSCK_DAMAGE_EXIT = 1


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _time(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _jsonable(v: Any) -> Any:
    """Non-tensor state values for --json output."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, bytes):
        return {"bytes": len(v)}
    if isinstance(v, (np.generic,)):
        return _jsonable(v.item())
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


def _commit_json(c: Commit) -> dict[str, Any]:
    return {
        "id": c.id,
        "parents": list(c.parents),
        "author": c.author,
        "time": _time(c.time_ns),
        "time_ns": c.time_ns,
        "message": c.message,
        "metrics": {k: _jsonable(v) for k, v in c.metrics.items()},
        "metadata": dict(c.metadata),
        "pickled": c.pickled,
    }


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
            self._repo = Repo.open(self.directory)
        return self._repo

    def close(self) -> None:
        if self._repo is not None:
            self._repo.close()


class CkvcGroup(click.Group):
    """Turns CkvcError into one line on stderr and the error's exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CkvcError as exc:
            click.echo(f"ckvc: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("ckvc: interrupted", err=True)
            ctx.exit(130)


json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")


@click.group(cls=CkvcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-C", "directory", default=".", metavar="DIR", help="Run as if started in DIR (like git -C).")
@click.version_option(package_name="ckvc")
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
    """Create a repository in DIRECTORY (default: the current one)."""
    path = Path(obj.directory, directory) if directory else Path(obj.directory)
    repo = Repo.init(path, chunk_size=chunk_size, default_branch=default_branch)
    repo.close()
    if as_json:
        _emit_json({"path": str(repo.dir)})
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
@json_option
@click.pass_obj
def commit(
    obj: Context, path: Path, message: str, metrics: tuple[str, ...], meta: tuple[str, ...], as_json: bool
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
    state, source_meta = read_checkpoint(path)
    metadata = {**source_meta, **_parse_pairs(meta, "--meta")}
    with _progress_bar("commit", not as_json) as progress:
        commit_id = repo.commit(state, message=message, metrics=metric_values, metadata=metadata, progress=progress)
    stats = repo.last_commit_stats
    assert stats is not None
    branch, _ = repo.head()
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
            }
        )
    else:
        click.echo(
            f"[{branch or 'detached HEAD'} {commit_id[:12]}] {message}\n"
            f" {human_bytes(stats.logical_bytes)} in {stats.chunks} chunks, {stats.new_chunks} new; "
            f"{human_bytes(stats.stored_bytes)} written in {stats.seconds:.2f} s"
        )


@cli.command()
@click.argument("rev", default="HEAD")
@click.option("--oneline", is_flag=True, help="One line per commit.")
@click.option("-n", "--max-count", type=int, default=None, help="Show at most N commits.")
@json_option
@click.pass_obj
def log(obj: Context, rev: str, oneline: bool, max_count: int | None, as_json: bool) -> None:
    """Show the commits reachable from REV, newest first, with their metrics."""
    repo = obj.repo
    commits = repo.log(rev, limit=max_count)
    if as_json:
        _emit_json([_commit_json(c) for c in commits])
        return
    labels = _labels(repo)
    for c in commits:
        deco = f" ({', '.join(labels[c.id])})" if c.id in labels else ""
        first_line = c.message.splitlines()[0] if c.message else ""
        if oneline:
            metrics = f"  [{_metrics_text(c.metrics)}]" if c.metrics else ""
            click.echo(f"{c.id[:12]}{deco} {first_line}{metrics}")
            continue
        click.echo(f"commit {c.id}{deco}")
        if len(c.parents) > 1:
            click.echo("Merge:  " + " ".join(p[:12] for p in c.parents))
        click.echo(f"Author: {c.author}\nDate:   {_time(c.time_ns)}")
        if c.metrics:
            click.echo(f"Metrics: {_metrics_text(c.metrics)}")
        click.echo("")
        for line in (c.message or "(no message)").splitlines():
            click.echo(f"    {line}")
        click.echo("")


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
    return labels


def _tensor_json(t: TensorSummary) -> dict[str, Any]:
    return {"path": t.path, "dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes, "kind": t.kind}


@cli.command()
@click.argument("rev", default="HEAD")
@json_option
@click.pass_obj
def show(obj: Context, rev: str, as_json: bool) -> None:
    """Show a commit: message, metrics, and its tensors with dtype, shape and size."""
    info = obj.repo.show(rev)
    c = info.commit
    if as_json:
        _emit_json(
            {
                **_commit_json(c),
                "logical_bytes": info.logical_bytes,
                "stored_bytes": info.stored_bytes,
                "tensors": [_tensor_json(t) for t in info.tensors],
                "values": {k: _jsonable(v) for k, v in info.values.items()},
            }
        )
        return
    click.echo(f"commit {c.id}\nAuthor: {c.author}\nDate:   {_time(c.time_ns)}")
    if c.metrics:
        click.echo(f"Metrics: {_metrics_text(c.metrics)}")
    if c.metadata:
        click.echo("Metadata: " + " ".join(f"{k}={v}" for k, v in c.metadata.items()))
    click.echo(f"\n    {c.message or '(no message)'}\n")
    click.echo(
        f"{len(info.tensors)} tensors, {human_bytes(info.logical_bytes)} logical, "
        f"{human_bytes(info.stored_bytes)} stored"
    )
    width = max((len(t.path) for t in info.tensors), default=0)
    for t in info.tensors:
        click.echo(f"  {t.path:<{width}}  {t.dtype:<10} {list(t.shape)!s:<20} {human_bytes(t.nbytes):>10}")
    if info.values:
        click.echo("values:")
        for path, value in info.values.items():
            click.echo(f"  {path or '<root>'} = {value!r:.100}")


@cli.command()
@click.argument("a")
@click.argument("b")
@json_option
@click.pass_obj
def diff(obj: Context, a: str, b: str, as_json: bool) -> None:
    """Tensors added, removed and changed from A to B (relative L2 change, max abs difference)."""
    d = obj.repo.diff(a, b)
    if as_json:
        _emit_json(
            {
                "a": d.a,
                "b": d.b,
                "added": d.added,
                "removed": d.removed,
                "changed": [
                    {
                        "path": c.path,
                        "old": _tensor_json(c.old),
                        "new": _tensor_json(c.new),
                        "rel_l2": _jsonable(c.rel_l2),
                        "max_abs": _jsonable(c.max_abs),
                    }
                    for c in d.changed
                ],
                "values_changed": [
                    {"path": p, "old": _jsonable(x), "new": _jsonable(y)} for p, x, y in d.values_changed
                ],
            }
        )
        return
    for path in d.added:
        click.echo(f"+ {path}")
    for path in d.removed:
        click.echo(f"- {path}")
    for c in d.changed:
        if c.rel_l2 is None:
            click.echo(f"~ {c.path}  {c.old.dtype}{list(c.old.shape)} -> {c.new.dtype}{list(c.new.shape)}")
        else:
            click.echo(f"~ {c.path}  rel_l2={c.rel_l2:.3e} max_abs={c.max_abs:.3e}")
    for path, old, new in d.values_changed:
        click.echo(f"~ {path}  {old!r:.60} -> {new!r:.60}")
    if not (d.added or d.removed or d.changed or d.values_changed):
        click.echo("no differences")


@cli.command()
@click.argument("rev")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None, help="Also write the state here.")
@json_option
@click.pass_obj
def checkout(obj: Context, rev: str, output: Path | None, as_json: bool) -> None:
    """Move HEAD to REV; with -o also write its state (.pt, .safetensors, or a directory)."""
    repo = obj.repo
    written: list[Path] = []
    if output is not None:
        if not output.is_absolute():
            output = Path(obj.directory) / output
        with _progress_bar("checkout", not as_json) as progress:
            state = repo.load(rev, map_location="cpu", progress=progress)
        commit = repo.read_commit(repo.resolve(rev))
        written = write_checkpoint(state, output, dict(commit.metadata))
    commit_id = repo.switch(rev)
    branch, _ = repo.head()
    if as_json:
        _emit_json({"commit": commit_id, "branch": branch, "written": [str(p) for p in written]})
        return
    where = f"branch '{branch}'" if branch else f"detached HEAD at {commit_id[:12]}"
    click.echo(f"Switched to {where}")
    for p in written:
        click.echo(f"wrote {p}")


@cli.command()
@click.option("-d", "--delete", is_flag=True, help="Delete the branch NAME.")
@click.argument("name", required=False)
@click.argument("rev", required=False, default="HEAD")
@json_option
@click.pass_obj
def branch(obj: Context, delete: bool, name: str | None, rev: str, as_json: bool) -> None:
    """List branches, create NAME at REV, or delete NAME with -d."""
    repo = obj.repo
    if name is None:
        if delete:
            raise InvalidInputError("branch -d needs a NAME")
        current, _ = repo.head()
        branches = repo.branches()
        if as_json:
            _emit_json({"current": current, "branches": branches})
        else:
            for n, oid in branches.items():
                click.echo(f"{'*' if n == current else ' '} {n:<20} {oid[:12]}")
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
@click.argument("name", required=False)
@click.argument("rev", required=False, default="HEAD")
@json_option
@click.pass_obj
def tag(obj: Context, delete: bool, message: str | None, name: str | None, rev: str, as_json: bool) -> None:
    """List tags, create NAME at REV (annotated with -m), or delete NAME with -d."""
    repo = obj.repo
    if name is None:
        if delete:
            raise InvalidInputError("tag -d needs a NAME")
        tags = repo.tags()
        if as_json:
            _emit_json(tags)
        else:
            for n, oid in tags.items():
                click.echo(f"{n:<20} {oid[:12]}")
        return
    if delete:
        oid = repo.delete_tag(name)
        _done(as_json, {"deleted": name, "was": oid}, f"Deleted tag {name} (was {oid[:12]})")
    else:
        oid = repo.tag(name, rev, message)
        _done(as_json, {"created": name, "target": oid}, f"Created tag {name} at {repo.resolve(name)[:12]}")


def _done(as_json: bool, payload: dict[str, Any], text: str) -> None:
    if as_json:
        _emit_json(payload)
    else:
        click.echo(text)


@cli.command()
@click.option("--rebuild-index", is_flag=True, help="Rebuild the index from the pack files first.")
@json_option
@click.pass_obj
def fsck(obj: Context, rebuild_index: bool, as_json: bool) -> None:
    """Verify every stored byte against its hash, and the refs and commit graph.
    Exits 1 and names each damaged object when anything is wrong."""
    with _progress_bar("fsck", not as_json) as progress:
        report = obj.repo.fsck(rebuild_index=rebuild_index, progress=progress)
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
    if usage.per_commit:
        click.echo("unique bytes per commit (what dropping it alone would free):")
        for c in usage.per_commit:
            first = c.message.splitlines()[0] if c.message else ""
            click.echo(f"  {c.commit[:12]}  {human_bytes(c.unique_stored_bytes):>10}  {first}")


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
    """Where HEAD is."""
    branch_name, commit_id = obj.repo.head()
    if as_json:
        _emit_json({"branch": branch_name, "commit": commit_id})
    elif commit_id is None:
        click.echo(f"On branch {branch_name}, no commits yet")
    else:
        click.echo(f"On branch {branch_name}" if branch_name else "HEAD detached")
        click.echo(f"at {commit_id}")


def main() -> None:
    cli(prog_name="ckvc")
