"""The ``ckvc`` command group: the Context each command gets (the repository,
opened on first use), error rendering and the exception -> exit code mapping, and
``main()``, the console entry point.

Exit codes: 0 success; 1 fsck found damage; 2 usage error (click);
3 and up: one per error class (see ckvc.errors, ``exit_code``). A user error
prints one line on stderr, never a traceback.

The commands live in one module per group of verbs (settings, commit, history,
branches, checkout, maintenance, remotes, caching, serve), each registering its
commands on ``cli`` when imported; ``ckvc/cli/__init__.py`` imports them all.
This module imports none of them, so they can import ``cli`` and ``Context`` from
here. Only click and ckvc.errors load up front: --help, log, status, branch, tag,
reflog, config and du never import torch (1.5 s); commands that read or write
tensors import ckvc.formats / ckvc.state / torch in their own bodies.
tests/cli/test_cli_startup.py checks this in a fresh interpreter.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import select
import signal
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ckvc.errors import CkvcError, InvalidInputError

if TYPE_CHECKING:
    from ckvc.repo import Repo

FSCK_DAMAGE_EXIT = 1  # ckvc fsck found damage


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
# What git's exit status is when the reader of its output goes (`ckvc log | head`):
# 128 + SIGPIPE. ckvc keeps SIGPIPE ignored (a dropped socket must stay an error)
# and ends the same way, silently, when the pipe that broke is its stdout.
PIPE_CLOSED_EXIT = 128 + signal.SIGPIPE


def _stdout_closed(exc: BaseException) -> bool:
    """``exc`` is EPIPE and stdout's reader has gone (poll says so of a pipe's write
    end with no reader; an S3 socket that broke is not stdout)."""
    if not (isinstance(exc, OSError) and exc.errno == errno.EPIPE):
        return False
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # stdout closed or replaced (a test's capture)
        return False


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the flush at exit has nowhere to fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    finally:
        os.close(devnull)


def _exit_code_for(exc: BaseException, command: str | None) -> int:
    """Print one line for ``exc`` and return the exit code: a CkvcError's own; an
    OSError or lmdb error as the typed StorageError it maps to; Ctrl-C 130;
    stdout's reader gone (``| head``) nothing, 141 (PIPE_CLOSED_EXIT); any
    other exception (a bug) UnexpectedError's 70, with the traceback only when
    $CKVC_DEBUG is set."""
    from ckvc.errors import InterruptedOperationError, UnexpectedError, is_storage_exception, storage_error

    if _stdout_closed(exc):
        _silence_stdout()
        return PIPE_CLOSED_EXIT
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
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output from the command (as its own --json).")
@click.pass_context
def cli(ctx: click.Context, directory: str, as_json: bool) -> None:
    """ckvc: version control for deep-learning checkpoints."""
    if not Path(directory).is_dir():
        raise InvalidInputError(f"cannot change to {directory}: not a directory")
    obj = Context(directory)
    ctx.obj = obj
    ctx.call_on_close(obj.close)


def _ignore_sigint() -> None:
    """From here to exit a Ctrl-C changes nothing: the outcome is decided (and a
    signal already caught but not yet handled is dropped with the handler)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def main() -> None:
    """The ``ckvc`` entry point: no error leaves it as a traceback (``_exit_code_for``);
    errors after a command returns (closing the repository) are mapped too."""
    decided: list[int] = []
    try:
        _run_command(decided)
    except KeyboardInterrupt:  # a Ctrl-C in the instant before SIGINT is ignored
        _ignore_sigint()
        if not decided:
            decided.append(_exit_code_for(KeyboardInterrupt(), None))
    code = decided[0]
    try:  # what is still buffered goes now, where a closed pipe is handled, not at exit
        sys.stdout.flush()
    except OSError as exc:
        code = _exit_code_for(exc, None)
    sys.exit(code)


def _run_command(decided: list[int]) -> None:
    """Run the command and put its exit code in ``decided``; then SIGINT is
    ignored: once the outcome is decided (and said), a Ctrl-C while the last line
    is flushed or the interpreter shuts down (library finalizers run after
    atexit) must neither add a traceback nor change it."""
    warnings.showwarning = functools.partial(_show_warning, set())
    code: Any
    try:
        # Not click's standalone mode: it turns a Ctrl-C outside the command body
        # (closing the repository, writing the last line) into "Aborted!" and exit 1.
        code = cli.main(prog_name="ckvc", standalone_mode=False)
    except SystemExit as exc:
        code = exc.code
    except click.ClickException as exc:  # usage errors: click's own message, exit 2
        exc.show()
        code = exc.exit_code
    except click.exceptions.Abort as exc:
        code = _exit_code_for(
            exc.__cause__ if isinstance(exc.__cause__, KeyboardInterrupt) else KeyboardInterrupt(), None
        )
    except BaseException as exc:
        code = _exit_code_for(exc, None)
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # a SystemExit with a message, as the interpreter would
        code = 1
    decided.append(code or 0)
    _ignore_sigint()
