"""What every ``ckvc`` command shares: the ``--json`` option and JSON output, warnings
on stderr, progress bars, human-readable sizes, times, metrics and codec tables.

Imports only click and the standard library up front (``ckvc --help`` and the
history commands load no torch); tqdm and ckvc.inspect load when first used.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import click

# One byte formatter for the CLI and the retention plans (the CLI's commands import it from here).
from ckvc.retention_policy import format_size as human_bytes

if TYPE_CHECKING:
    from ckvc.inspect import CodecUsage


def time_text(ns: int) -> str:
    """A time as every command prints it (ckvc.inspect's, loaded on first use)."""
    from ckvc.inspect import time_text as inspect_time_text

    return inspect_time_text(ns)


def warn(text: str) -> None:
    """A warning: one line on stderr, also under --json (stdout holds only results)."""
    click.echo(f"ckvc: warning: {text}", err=True)


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


def metrics_text(metrics: Any) -> str:
    return " ".join(f"{k}={v:.6g}" for k, v in metrics.items())


@contextmanager
def progress_bar(label: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
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


def _json_anywhere(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    """``ckvc log --json`` or ``ckvc --json log``: the group's flag counts for every command."""
    return value or bool(ctx.find_root().params.get("as_json"))


json_option = click.option("--json", "as_json", is_flag=True, callback=_json_anywhere, help="Machine-readable output.")


def echo_codecs(by_codec: Mapping[str, CodecUsage]) -> None:
    """Stored bytes per codec: where the space goes, and how well each codec does."""
    if not by_codec:
        return
    click.echo("by codec:          raw / stored (distinct chunks)")
    for name, c in by_codec.items():
        click.echo(
            f"  {name:<16} {human_bytes(c.raw_bytes):>10} / {human_bytes(c.stored_bytes):>10}  "
            f"{c.ratio:6.3f} of raw  {c.chunks} chunks"
        )
