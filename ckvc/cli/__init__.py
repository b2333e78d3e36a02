"""The ``ckvc`` command line. Parses arguments, calls Repo, renders text or --json.

One module per group of verbs, like git's builtin/ and restic's cmd_*.go:

- ``main``: the click group ``cli``, the Context, error rendering, exit codes, ``main()``
- ``output``: what the commands share (--json, progress bars, sizes, times)
- ``settings``: init, config
- ``commit``: commit, import
- ``history``: log, show, diff, reflog, status
- ``branches``: branch, tag, switch
- ``checkout``: checkout, export
- ``maintenance``: fsck, gc, retain, du
- ``remotes``: remote, push, fetch, pull, clone, ls-remote
- ``caching``: cache (pin, unpin, prune)
- ``serve``: serve

Each command module registers its commands on ``cli`` when imported; this package
imports them all, so ``from ckvc.cli import cli`` (and the ``ckvc`` console script,
``ckvc.cli:main``) has every command. None of them imports torch at module level.
"""

from __future__ import annotations

from ckvc.cli import (  # noqa: F401  (imported for their commands, registered on cli)
    branches,
    caching,
    checkout,
    commit,
    history,
    maintenance,
    remotes,
    serve,
    settings,
    trust,
)
from ckvc.cli.main import cli, main
from ckvc.cli.output import progress_bar as _progress_bar  # noqa: F401  (tests/test_throughput.py imports it)

__all__ = ["cli", "main"]
