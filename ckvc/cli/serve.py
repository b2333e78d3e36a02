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
@click.option(
    "--token",
    envvar="CKVC_SERVE_TOKEN",
    help="The token every request must carry (default off loopback: a new random one, printed in the URL).",
)
@click.option(
    "--no-auth", is_flag=True, help="Off loopback, serve without a token (anyone who can reach it reads all)."
)
@click.pass_obj
def serve(
    obj: object, host: str, port: int, open_browser: bool, verbose: bool, token: str | None, no_auth: bool
) -> None:
    """Serve a read-only web UI of this repository: history, metrics, commits,
    diffs and storage, also as JSON under /api/. Stops on Ctrl-C.

    On loopback (the default) no token is asked unless --token gives one. On any
    other address every request needs a token, as Jupyter's do: the printed URL
    carries it once and the browser keeps it in a cookie; scripts send
    'Authorization: token T'."""
    from ckvc.repo import Repo
    from ckvc.web import is_loopback, make_server, new_token

    directory: str = getattr(obj, "directory", ".")
    if no_auth and token is not None:
        raise InvalidInputError("--no-auth and --token contradict each other")
    if not is_loopback(host):
        if no_auth:
            click.echo(
                f"ckvc: warning: serving on {host}, not loopback, without a token (--no-auth): anyone who can "
                "reach this machine can read this repository's history, metrics and tensors",
                err=True,
            )
        elif token is None:
            token = new_token()
    try:
        server = make_server(lambda: Repo.open(directory), host, port, verbose=verbose, token=token)
    except OSError as exc:
        raise InvalidInputError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    # Ctrl-C and a plain kill stop it the same way, even where the shell that
    # started it in the background set SIGINT to be ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        url = server.url if token is None else f"{server.url}?token={token}"
        click.echo(f"ckvc serve: {url}  (read-only; Ctrl-C stops)")
        if open_browser:
            import webbrowser

            webbrowser.open(url)
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        click.echo("ckvc serve: stopped", err=True)
    finally:
        server.server_close()
        server.api.close()
