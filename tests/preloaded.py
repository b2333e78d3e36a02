"""Child processes that start from an interpreter that has imported torch, ckvc,
transformers and both Lightning packages already: a forkserver, one per test
session, started on first use. A child costs a fork, not 3-10 s of imports.

It is still its own process: SIGKILL and exit statuses as ``subprocess`` reports
them (``-9`` for a kill), its own stdout and stderr (captured), the caller's
environment and working directory at the moment of the call. Imports that read
the environment (the Hugging Face hub's offline switch) happened in the server,
which was started with the test session's environment: tests/conftest.py sets
the offline switches for the whole session, so every child is offline too.

``run_script(path, args)`` runs a Python file as ``__main__``, like ``python path
args``; tests/distributed/ranks.py starts its gloo ranks from the same server.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# What children import, loaded once in the server (a module that fails to import
# there is imported by the child as usual).
PRELOAD = [
    "torch", "torch.distributed", "numpy", "ckvc", "ckvc.distributed", "ckvc.dcp", "ckvc.integrations.transformers",
    "ckvc.integrations.lightning", "transformers", "lightning", "pytorch_lightning",
    "rank_fns", "bucket_fns", "dcp_fns",
]  # fmt: skip
CONTEXT = multiprocessing.get_context("forkserver")
CONTEXT.set_forkserver_preload(PRELOAD)


@dataclass
class Completed:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would give."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


def become(env: dict[str, str], cwd: str) -> None:
    """In a child: the caller's environment and working directory."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)


def _script_main(path: str, args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    become(env, cwd)
    for fd, name in ((1, out), (2, err)):
        target = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))  # as `python path` sets it
    # SystemExit and exceptions end the child as they would the interpreter (exit
    # status, traceback on stderr); as in any multiprocessing child, atexit handlers
    # do not run, so the scripts close what they open.
    runpy.run_path(path, run_name="__main__")


def run_script(
    path: str | Path, args: list[str], *, env: dict[str, str] | None = None, timeout: float = 600
) -> Completed:
    """``python path args`` in a preloaded child; its output captured as text."""
    with tempfile.TemporaryDirectory(prefix="ckvc-child-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = CONTEXT.Process(
            target=_script_main, args=(str(path), list(args), dict(env or os.environ), os.getcwd(), out, err)
        )
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise TimeoutError(f"{path} {args} did not finish within {timeout} s")
        assert child.exitcode is not None
        return Completed([str(path), *args], child.exitcode, Path(out).read_text(), Path(err).read_text())
