"""Hooks: a shell command run after a commit lands (``post_commit``) or a push
succeeds (``post_push``), set with ``ckvc config hooks.post_commit "COMMAND"``.

A hook runs in the background, in the repository's root, with what happened in
its environment (CKVC_HOOK, CKVC_COMMIT, CKVC_BRANCH, CKVC_MESSAGE, CKVC_METRICS as
JSON, CKVC_REMOTE for a push, CKVC_REPOSITORY). Its output and exit status go to
``.ckvc/logs/hooks.log``; a failing hook is a warning and never touches the commit;
one still running after ``hooks.timeout`` seconds (default 60) is killed with its
process group. Every commit path runs it (it is a commit observer on the core), so
does a DCP save and a distributed commit (on the coordinator). ``CKVC_NO_HOOKS=1``
skips hooks for a process, as git's ``--no-verify``. At interpreter exit, hooks
still running are waited for, each up to its timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckvc.errors import CkvcWarning, InvalidInputError
from ckvc.storage.durable import write_atomic

if TYPE_CHECKING:
    from ckvc.core import Repository
    from ckvc.write import Committed

HOOKS_FILE = "hooks.json"
HOOK_NAMES = ("post_commit", "post_push")
DEFAULT_TIMEOUT_S = 60.0
LOG = Path("logs") / "hooks.log"


@dataclass
class HookSettings:
    post_commit: str | None = None
    post_push: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S

    @classmethod
    def load(cls, repo_dir: Path) -> HookSettings:
        try:
            data = json.loads((repo_dir / HOOKS_FILE).read_text())
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            raise InvalidInputError(f"{repo_dir / HOOKS_FILE} is not readable JSON: {exc}") from None
        if not isinstance(data, dict) or set(data) - {*HOOK_NAMES, "timeout"}:
            raise InvalidInputError(f"{repo_dir / HOOKS_FILE}: expected keys {', '.join((*HOOK_NAMES, 'timeout'))}")
        return cls(**data).validate(repo_dir / HOOKS_FILE)

    def validate(self, where: Path | str = HOOKS_FILE) -> HookSettings:
        for name in HOOK_NAMES:
            command = getattr(self, name)
            if command is not None and (not isinstance(command, str) or not command.strip() or "\0" in command):
                raise InvalidInputError(f"{where}: hooks.{name} must be a non-empty command")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, int | float) or not 0 < self.timeout <= 86400:
            raise InvalidInputError(f"{where}: hooks.timeout must be seconds in (0, 86400], got {self.timeout!r}")
        return self

    def save(self, repo_dir: Path) -> None:
        write_atomic(repo_dir / HOOKS_FILE, (json.dumps(asdict(self), indent=2, sort_keys=True) + "\n").encode())


def set_hook(core: Repository, key: str, value: str | None) -> HookSettings:
    """``key``: post_commit, post_push or timeout; ``value`` None (or "none") unsets a command."""
    if core.dir is None:
        raise InvalidInputError("hooks are set on a local repository")
    settings = HookSettings.load(core.dir)
    if key == "timeout":
        try:
            settings.timeout = float(value or "")
        except ValueError:
            raise InvalidInputError(f"hooks.timeout must be a number of seconds, got {value!r}") from None
    elif key in HOOK_NAMES:
        setattr(settings, key, None if value in (None, "", "none") else value)
    else:
        raise InvalidInputError(f"unknown hook {key!r}; known: {', '.join((*HOOK_NAMES, 'timeout'))}")
    settings.validate().save(core.dir)
    attach(core)  # this process's next commits use it too
    return settings


class HookRunner:
    """The hooks of one open repository: a commit observer, and ``run`` for pushes."""

    def __init__(self, core: Repository, settings: HookSettings) -> None:
        assert core.path is not None and core.dir is not None
        self.core, self.settings = core, settings
        self.root, self.log = core.path, core.dir / LOG

    def on_commit(self, event: Committed) -> None:
        if self.settings.post_commit is None:
            return
        commit = self.core.read_commit(event.commit)
        branch = event.head.target.removeprefix("refs/heads/") if event.head.target else ""
        self.run(
            "post_commit",
            {
                "CKVC_COMMIT": commit.id,
                "CKVC_BRANCH": branch,
                "CKVC_MESSAGE": commit.message,
                "CKVC_METRICS": json.dumps(dict(commit.metrics), sort_keys=True),
            },
        )

    def run(self, hook: str, env: dict[str, str]) -> None:
        """Start ``hook`` in the background; its waiter logs the outcome."""
        command = getattr(self.settings, hook)
        if command is None or os.environ.get("CKVC_NO_HOOKS") == "1":
            return
        full_env = {**os.environ, **env, "CKVC_HOOK": hook, "CKVC_REPOSITORY": str(self.root)}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        output = self.log.with_suffix(f".{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}.out")
        with open(output, "wb") as out:
            proc = subprocess.Popen(
                command,
                shell=True,
                cwd=self.root,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: a timeout kills what it started too
            )
        waiter = threading.Thread(
            target=self._wait, args=(hook, command, env, proc, output), name=f"ckvc-hook {hook}", daemon=True
        )
        with _running_lock:
            _running[:] = [t for t in _running if t.is_alive()]
            _running.append(waiter)
        waiter.start()

    def _wait(self, hook: str, command: str, env: dict[str, str], proc: subprocess.Popen[bytes], output: Path) -> None:
        started = time.monotonic()
        try:
            rc: int | None = proc.wait(self.settings.timeout)
            outcome = f"exit {rc}"
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            rc, outcome = None, f"killed after {self.settings.timeout:g} s"
        try:
            text = output.read_text(errors="replace")
            output.unlink()
        except OSError:
            text = ""
        what = env.get("CKVC_COMMIT", "")[:12] or env.get("CKVC_REMOTE", "")
        record = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "hook": hook,
            "command": command,
            "for": what,
            "outcome": outcome,
            "seconds": round(time.monotonic() - started, 3),
            "output": text[-4000:],
        }
        with _log_lock, open(self.log, "a") as log:
            log.write(json.dumps(record) + "\n")
        if rc != 0:
            warnings.warn(
                CkvcWarning(
                    f"{hook} hook for {what} failed ({outcome}); the {hook.split('_')[1]} stands. See {self.log}"
                ),
                stacklevel=1,
            )


_running: list[threading.Thread] = []
_running_lock = threading.Lock()
_log_lock = threading.Lock()


def attach(core: Repository) -> HookRunner | None:
    """Give ``core`` its hooks (replacing any attached before); None when none is set."""
    for observer in list(core.commit_observers):
        if isinstance(getattr(observer, "__self__", None), HookRunner):
            core.commit_observers.remove(observer)
    core.hooks = None
    if core.dir is None or not (core.dir / HOOKS_FILE).exists():
        return None
    settings = HookSettings.load(core.dir)
    if settings.post_commit is None and settings.post_push is None:
        return None
    runner = HookRunner(core, settings)
    core.commit_observers.append(runner.on_commit)
    core.hooks = runner
    return runner


def wait_for_hooks() -> None:
    """Hooks still running finish (each within its own timeout, which kills it)."""
    while True:
        with _running_lock:
            if not _running:
                return
            waiter = _running.pop(0)
        waiter.join()


def _wait_at_exit() -> int | None:
    wait_for_hooks()
    return None


def _register() -> None:
    from ckvc.core import at_exit

    at_exit("hooks", _wait_at_exit)


_register()
