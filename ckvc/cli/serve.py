"""`ckvc serve`: the read-only web UI (ckvc.web).
Imports no torch: pages that show tensors load it when first asked."""

from __future__ import annotations

import signal

import click

from ckvc.cli.main import cli
from ckvc.errors import InvalidInputError


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless asked).")
@click.option("--port", type=click.IntRange(0, 65535), default=0, show_default=True, help="0: any free port.")
@click.option("--open", "open_browser", is_flag=True, help="Open the page in the default browser.")
@click.option("-v", "--verbose", is_flag=True, help="Log every request on stderr.")
@click.pass_obj
def serve(obj: object, host: str, port: int, open_browser: bool, verbose: bool) -> None:
    """Serve a read-only web UI of this repository: history, metrics, commits,
    diffs and storage, also as JSON under /api/. Stops on Ctrl-C."""
    from ckvc.repo import Repo
    from ckvc.web import is_loopback, make_server

    directory: str = getattr(obj, "directory", ".")
    if not is_loopback(host):
        click.echo(
            f"ckvc: warning: serving on {host}, not loopback: anyone who can reach this machine "
            "can read this repository's history, metrics and tensors",
            err=True,
        )
    try:
        server = make_server(lambda: Repo.open(directory), host, port, verbose=verbose)
    except OSError as exc:
        raise InvalidInputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    # Ctrl-C and a plain kill stop it the same way, even where the shell that
    # started it in the background set SIGINT to be ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        click.echo(f"ckvc serve: {server.url}  (read-only; Ctrl-C stops)")
        if open_browser:
            import webbrowser

            webbrowser.open(server.url)
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        click.echo("ckvc serve: stopped", err=True)
    finally:
        server.server_close()
        server.api.close()
