"""Torture suite (issue 12): bad input, damage, faults, full disks, signals, races, deep states.

Every case runs ckvc in a child process (forked from a server that has ckvc and
torch imported, so a case costs milliseconds, not an interpreter start) with a
timeout and a data-size limit (RLIMIT_DATA), so a segfault, bus error, MemoryError or hang
is observed, not suffered. Each case gets one verdict:

- handled: success where success is right, or a typed ckvc error: a documented
  exit code (the table in docs/GUIDE.md), one ``ckvc: ...`` line on stderr, no
  traceback, and the working directory (repository and output paths) unchanged;
- failed: anything else (traceback, undocumented exit code, repository changed
  after a refusal, a call that failed after its branch moved, ...);
- integrity: an acknowledged commit lost or not bit-exact, fsck not clean after
  a fault, wrong bytes returned, a mixed-version output directory, a temporary
  file left after the next command;
- crash: segfault, bus error, MemoryError, RecursionError, hang (timeout).

    python benchmarks/torture.py                 # the short run (the default test suite runs it)
    python benchmarks/torture.py --long          # the long run (also: CKVC_TORTURE=1 pytest tests/reliability/torture)
    python benchmarks/torture.py --case 'cli/log rev=nonutf8' -v   # one case, with its output
    python benchmarks/torture.py --category faults --json

Seeds are fixed (``--seed``) and printed; a case name plus the seed and mode
reproduces it.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import dataclasses
import errno as errno_mod
import functools
import hashlib
import io
import json
import os
import pickle
import random
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
GUIDE = REPO_ROOT / "docs" / "GUIDE.md"

HANDLED, FAILED, INTEGRITY, CRASH = "handled", "failed", "integrity", "crash"
VERDICTS = (HANDLED, FAILED, INTEGRITY, CRASH)
CATEGORIES = ("cli", "crafted", "faults", "diskfull", "readonly", "signals", "writers", "deep", "remote")

DEFAULT_SEED = 12
CASE_TIMEOUT_S = 30.0
MEMORY_BUDGET = 3 << 30  # address space a child may add on top of what it starts with
# Names a temporary file or directory ckvc leaves behind would have.
TEMP_NAME = re.compile(r"(tmp|temp|\.partial|\.ckvc-init-|\.ckvc-checkout|\.ckvc-export)", re.IGNORECASE)


# ---------------------------------------------------------------------------
# Child side: runs in a process forked from the preloaded server.
# ---------------------------------------------------------------------------


def state_digest(value: Any) -> str:
    """A hash of a state's structure, types and raw bytes (NaN payloads and -0.0
    count). Iterative, so states nested thousands deep do not recurse."""
    import numpy as np
    import torch

    h = hashlib.blake2b(digest_size=16)
    stack: list[Any] = [value]
    while stack:
        v = stack.pop()
        h.update(type(v).__name__.encode() + b"\0")
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(v, np.ndarray):
            h.update(f"{v.dtype}{v.shape}".encode() + np.ascontiguousarray(v).tobytes())
        elif isinstance(v, dict):
            h.update(str(len(v)).encode())
            for k, x in reversed(list(v.items())):
                stack.append(x)
                stack.append(("key", repr(k)))
        elif isinstance(v, (list, tuple)) and type(v) is not torch.Size:
            h.update(str(len(v)).encode())
            stack.extend(reversed(v))
        elif isinstance(v, float):
            h.update(struct.pack("<d", v))
        else:
            h.update(repr(v).encode(errors="backslashreplace"))
    return h.hexdigest()


def _child_cli(argv: list[str]) -> int:
    from ckvc.cli import main

    sys.argv = ["ckvc", *argv]
    main()
    return 0


def _child_commit_state(repo_dir: str, spec: str, message: str) -> int:
    """Commit STATE_BUILDERS[spec] through the library; prints its id and digest."""
    import ckvc

    state = build_state(spec)
    repo = ckvc.Repo.open(repo_dir)
    try:
        commit_id = repo.commit(state, message=message)
    except ckvc.CkvcError as exc:  # the library's typed refusal, told as the CLI would
        print(f"ckvc: error: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        repo.close()
    print(json.dumps({"commit": commit_id, "digest": state_digest(state)}), flush=True)
    return 0


def _child_craft_tree(repo_dir: str, craft: str) -> int:
    """Commit a small real state whose encoded tree is replaced by CRAFTED_TREES[craft]
    (the blobs stay real): what a damaged or malicious repository can hold."""
    import torch

    import ckvc
    import ckvc.repo
    import ckvc.state

    real = ckvc.state.encode_state

    def crafted(state: Any, **kw: Any) -> Any:
        encoded = real(state, **kw)
        return encoded._replace(tree=CRAFTED_TREES[craft](encoded.tree))

    for module in (ckvc.state, ckvc.repo):  # repo.py calls it through the state module today
        if hasattr(module, "encode_state"):
            setattr(module, "encode_state", crafted)  # noqa: B010 - the attribute may be missing
    repo = ckvc.Repo.open(repo_dir)
    commit_id = repo.commit({"w": torch.arange(16, dtype=torch.float32), "n": 1}, message=f"crafted {craft}")
    repo.close()
    print(json.dumps({"commit": commit_id}), flush=True)
    return 0


def _child_verify(repo_dir: str, expected: dict[str, str], branch: str | None) -> int:
    """Load every expected commit and compare digests; report the branch tip.
    Prints {"tip": id, "commits": {id: "ok" | "mismatch" | "error: ..."}}."""
    import ckvc

    out: dict[str, Any] = {"commits": {}}
    repo = ckvc.Repo.open(repo_dir)
    if branch is not None:
        out["tip"] = repo.branches().get(branch)
    for commit_id, digest in expected.items():
        try:
            got = state_digest(repo.load(commit_id, map_location="cpu"))
            out["commits"][commit_id] = "ok" if got == digest else "mismatch"
        except Exception as exc:  # reported, judged by the parent
            out["commits"][commit_id] = f"error: {type(exc).__name__}: {exc}"[:300]
    repo.close()
    print(json.dumps(out), flush=True)
    return 0


def _child_selftest(what: str) -> int:
    """Misbehaves on purpose, so the tests can check that the runner observes it."""
    if what == "segv":
        import ctypes

        ctypes.string_at(0)
    elif what == "hang":
        time.sleep(3600)
    elif what == "memory":
        _ = bytearray(MEMORY_BUDGET + (1 << 30))
    elif what == "recursion":

        def down(n: int) -> int:
            return down(n + 1) + 1

        down(0)
    elif what == "faults":  # one write through os, counted and refused by the fault wrappers
        fd = os.open("selftest.txt", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"x")
    return 0


CHILD_KINDS: dict[str, Callable[..., int]] = {
    "selftest": _child_selftest,
    "cli": _child_cli,
    "commit_state": _child_commit_state,
    "craft_tree": _child_craft_tree,
    "verify": _child_verify,
}

# os functions that change the filesystem, wrapped for fault injection. os.open
# counts only when it opens for writing or creates.
FAULT_TARGETS = (
    "open",
    "write",
    "writev",
    "pwrite",
    "fsync",
    "fdatasync",
    "rename",
    "replace",
    "mkdir",
    "unlink",
    "remove",
    "rmdir",
    "ftruncate",
    "link",
    "symlink",
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT


@functools.lru_cache(maxsize=1)
def ckvc_dir() -> str:
    """The ckvc package's directory, with a trailing separator."""
    import ckvc

    return str(Path(ckvc.__file__).parent) + os.sep


def ckvc_relpath(filename: str) -> str | None:
    """'ckvc/x.py' for a file of the ckvc package, else None."""
    return "ckvc/" + filename[len(ckvc_dir()) :] if filename.startswith(ckvc_dir()) else None


def _ckvc_caller() -> str | None:
    """file:line of the innermost ckvc frame calling, or None when ckvc is not on the stack."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        if rel := ckvc_relpath(frame.f_code.co_filename):
            return f"{rel}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _install_faults(spec: dict[str, Any]) -> Callable[[], list[str]]:
    """Wrap FAULT_TARGETS (and builtins/io.open for writing). The k-th call made
    from ckvc code (1-based) raises OSError(errno); with persist, every later one
    too; k=0 only records. Returns a function giving the calls seen, as
    'name@file:line'."""
    import builtins

    calls: list[str] = []
    lock = threading.Lock()
    k, persist, err = spec["k"], spec["persist"], spec["errno"]

    def gate(name: str) -> None:
        where = _ckvc_caller()
        if where is None:
            return
        with lock:
            calls.append(f"{name}@{where}")
            n = len(calls)
        # A full disk still lets files be removed (that frees space): a persistent
        # ENOSPC spares unlink, remove and rmdir, as the kernel does.
        frees = err == errno_mod.ENOSPC and name in ("unlink", "remove", "rmdir")
        if k and (n == k or (persist and n > k and not frees)):
            raise OSError(err, f"{os.strerror(err)} (injected at {name} call {n})")

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if name != "open" or (len(args) > 1 and args[1] & _WRITE_FLAGS) or kwargs.get("flags", 0) & _WRITE_FLAGS:
                gate(name)
            return fn(*args, **kwargs)

        return wrapper

    for name in FAULT_TARGETS:
        if hasattr(os, name):
            setattr(os, name, wrap(name, getattr(os, name)))
    real_open = io.open

    @functools.wraps(real_open)
    def open_wrapper(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(c in mode for c in "wax+"):
            gate("io.open")
        return real_open(file, mode, *args, **kwargs)

    builtins.open = io.open = open_wrapper
    return lambda: list(calls)


def _child_main(
    kind: str, args: tuple[Any, ...], cwd: str, out: str, err: str, env: dict[str, str], faults: Any
) -> None:
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.update(env)
    # RLIMIT_DATA, not RLIMIT_AS: LMDB maps terabytes of address space it never
    # touches, while any large allocation (numpy, malloc) is private data.
    with open("/proc/self/status") as f:
        data = int(re.search(r"VmData:\s+(\d+) kB", f.read()).group(1)) << 10  # type: ignore[union-attr]
    resource.setrlimit(resource.RLIMIT_DATA, (data + MEMORY_BUDGET, data + MEMORY_BUDGET))
    os.chdir(cwd)
    calls = _install_faults(faults) if faults else None
    code = 0
    try:
        code = CHILD_KINDS[kind](*args)
    except SystemExit as exc:  # what click's main() ends with
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:  # as the interpreter would: a traceback and exit 1
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    if calls is not None and faults.get("record"):
        Path(faults["record"]).write_text("\n".join(calls()))
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------
# Parent side: spawning children and judging them.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Proc:
    """What one child did."""

    argv: list[str]
    rc: int | None  # exit status, None when killed by a signal or timed out
    signal: int | None
    timed_out: bool
    stdout: str
    stderr: str
    seconds: float

    def json(self) -> Any:
        """stdout as JSON (or its last line, after other output); None when it is not."""
        for text in (self.stdout, (self.stdout.strip().splitlines() or [""])[-1]):
            with contextlib.suppress(ValueError):
                return json.loads(text)
        return None


@dataclasses.dataclass
class Verdict:
    verdict: str
    detail: str = ""


def _send(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj)
    data = struct.pack("<I", len(data)) + data
    while data:
        data = data[os.write(fd, data) :]


def _recv(stream: Any) -> Any:
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError
    return pickle.loads(stream.read(struct.unpack("<I", head)[0]))  # noqa: S301 - our own server


def serve() -> None:
    """The fork server: reads (id, call) requests on stdin, forks a child per
    request, reports ('started', id, pid) and ('exited', id, wait status)."""
    import numpy  # noqa: F401
    import torch  # noqa: F401

    import ckvc.cli

    with contextlib.suppress(ImportError):  # the remote extra: its client library too (no runtime starts)
        import ckvc.remote.repository
        import ckvc.storage.cloud
        import ckvc.storage.retry  # noqa: F401

    ckvc_dir()
    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)
    children: dict[int, int] = {}
    pending = b""
    import select

    while True:
        ready, _, _ = select.select([requests], [], [], 0.002 if children else 0.2)
        if ready:
            chunk = os.read(requests, 1 << 16)
            if not chunk:
                return
            pending += chunk
        while len(pending) >= 4 and len(pending) >= 4 + struct.unpack("<I", pending[:4])[0]:
            size = struct.unpack("<I", pending[:4])[0]
            req_id, call = pickle.loads(pending[4 : 4 + size])  # noqa: S301 - from our parent
            pending = pending[4 + size :]
            pid = os.fork()
            if pid == 0:
                os.close(requests)
                os.close(replies)
                _child_main(*call)
            children[pid] = req_id
            _send(replies, ("started", req_id, pid))
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _send(replies, ("exited", children.pop(pid), status))


class _Child:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.exited = threading.Event()
        self.pid = 0
        self.status = 0


class Runner:
    """Starts children from a fork server that has ckvc, torch and the CLI imported."""

    def __init__(self, scratch: Path, timeout: float = CASE_TIMEOUT_S) -> None:
        self.scratch = scratch
        self.timeout = timeout
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
        }
        self._server = subprocess.Popen(
            [sys.executable, "-c", f"import {Path(__file__).stem} as t; t.serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._lock = threading.Lock()
        self._children: dict[int, _Child] = {}
        self._n = 0
        threading.Thread(target=self._read_replies, daemon=True).start()

    def _read_replies(self) -> None:
        assert self._server.stdout is not None
        while True:
            try:
                what, req_id, value = _recv(self._server.stdout)
            except EOFError:
                return
            child = self._children[req_id]
            if what == "started":
                child.pid = value
                child.started.set()
            else:
                child.status = value
                child.exited.set()

    def close(self) -> None:
        assert self._server.stdin is not None
        self._server.stdin.close()
        self._server.wait(30)

    def start(
        self,
        kind: str,
        *args: Any,
        cwd: Path,
        env: dict[str, str] | None = None,
        faults: dict[str, Any] | None = None,
    ) -> tuple[int, Callable[[float | None], Proc]]:
        """Start a child; returns (pid, finish) where finish(timeout) waits and collects."""
        with self._lock:
            self._n += 1
            req_id = self._n
            child = self._children[req_id] = _Child()
            out = self.scratch / f"child-{req_id}.out"
            err = self.scratch / f"child-{req_id}.err"
            env = {"CKVC_THREADS": "2", **(env or {})}
            assert self._server.stdin is not None
            _send(self._server.stdin.fileno(), (req_id, (kind, args, str(cwd), str(out), str(err), env, faults)))
        started = time.monotonic()
        if not child.started.wait(60):
            raise RuntimeError("the fork server does not answer")

        def finish(timeout: float | None = None) -> Proc:
            timed_out = not child.exited.wait(self.timeout if timeout is None else timeout)
            if timed_out:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGKILL)
                child.exited.wait()
            del self._children[req_id]
            code = os.waitstatus_to_exitcode(child.status)
            text = [p.read_text(errors="backslashreplace") if p.exists() else "" for p in (out, err)]
            for p in (out, err):
                p.unlink(missing_ok=True)
            argv = list(args[0]) if kind == "cli" else [kind, *map(str, args)]
            return Proc(
                argv,
                None if code < 0 or timed_out else code,
                -code if code < 0 and not timed_out else None,
                timed_out,
                text[0],
                text[1],
                time.monotonic() - started,
            )

        return child.pid, finish

    def run(self, kind: str, *args: Any, cwd: Path, timeout: float | None = None, **kw: Any) -> Proc:
        _, finish = self.start(kind, *args, cwd=cwd, **kw)
        return finish(timeout)

    def cli(self, argv: list[str], cwd: Path, **kw: Any) -> Proc:
        return self.run("cli", argv, cwd=cwd, **kw)


@functools.lru_cache(maxsize=1)
def documented_exit_codes() -> frozenset[int]:
    """The exit codes docs/GUIDE.md's table lists."""
    text = GUIDE.read_text()
    section = text[text.index("### Exit codes") :]
    return frozenset(int(m) for m in re.findall(r"^\| (\d+) \|", section, re.MULTILINE))


def _last_error_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else ""


def traceback_cause(stderr: str) -> str:
    """'ExcType at ckvc/x.py:12 (fn)' from a traceback: the innermost ckvc frame."""
    where = ""
    for m in re.finditer(r'File "([^"]+)", line (\d+), in (\S+)', stderr):
        rel = ckvc_relpath(m.group(1))
        if rel or not where.startswith("ckvc/"):
            where = f"{rel or Path(m.group(1)).name}:{m.group(2)} ({m.group(3)})"
    exc = _last_error_line(stderr).split(":")[0]
    return f"{exc} at {where}" if where else exc


def judge(proc: Proc, expect: str, *, fsck: bool = False) -> Verdict:
    """The verdict on one CLI run by its exit and output alone. expect: 'ok' (must
    succeed), 'err' (must be refused) or 'any'."""
    err = proc.stderr
    if proc.timed_out:
        return Verdict(CRASH, f"hang: no exit within {proc.seconds:.0f} s")
    if proc.signal is not None:
        return Verdict(CRASH, f"killed by {signal.Signals(proc.signal).name}")
    for fatal in ("MemoryError", "RecursionError", "Fatal Python error"):
        if fatal in err:
            return Verdict(CRASH, f"{fatal}: {traceback_cause(err)}")
    if "Traceback (most recent call last)" in err:
        return Verdict(FAILED, f"traceback: {traceback_cause(err)}: {_last_error_line(err)}")
    if proc.rc == 0:
        return Verdict(FAILED, "accepted (exit 0) but must be refused") if expect == "err" else Verdict(HANDLED)
    assert proc.rc is not None
    if proc.rc not in documented_exit_codes() or (proc.rc == 1 and not fsck):
        return Verdict(FAILED, f"exit {proc.rc} (not a distinct documented code): {_last_error_line(err)}")
    if expect == "ok" and not (fsck and proc.rc == 1):
        return Verdict(FAILED, f"refused (exit {proc.rc}) but must succeed: {_last_error_line(err)}")
    if proc.rc != 2 and not fsck:
        errors = [line for line in err.splitlines() if line.strip() and not line.startswith("ckvc: warning")]
        if len(errors) != 1 or not (errors[0].startswith("ckvc: ") or _is_json_error(errors[0], proc.rc)):
            return Verdict(FAILED, f"exit {proc.rc} without a one-line 'ckvc: ...' message: {err.strip()[:160]!r}")
    return Verdict(HANDLED)


def _is_json_error(line: str, rc: int) -> bool:
    """Under --json an error is one JSON object, {"error": {type, message, exit_code}}."""
    try:
        error = json.loads(line)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and error.get("exit_code") == rc and bool(error.get("message"))


def tree_state(root: Path) -> dict[str, str]:
    """Every entry under root: relative path -> content hash, link target or kind.
    LMDB's lock file and flock targets change on any open and are left out."""
    out: dict[str, str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath, name)
            rel = str(p.relative_to(root))
            if name == "lock.mdb":
                continue
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            elif p.is_file():
                out[rel] = hashlib.blake2b(p.read_bytes(), digest_size=12).hexdigest()
            else:
                out[rel] = "special"
    return out


def tree_diff(a: dict[str, str], b: dict[str, str]) -> str:
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return ", ".join(f"{k}{'+' if k not in a else '-' if k not in b else '~'}" for k in changed[:4]) + (
        f" (+{len(changed) - 4})" if len(changed) > 4 else ""
    )


def unchanged(
    before: dict[str, str], after: dict[str, str], proc: Proc, *, temporaries_allowed: bool = False
) -> Verdict | None:
    """None when a refused call left everything as it was. The LMDB index (a cache
    rebuilt from the packs) and new pack files (unreferenced, gc removes them) do not count.
    ``temporaries_allowed``: nor do new hidden temporaries, for a fault that makes
    their removal fail too (a persistent EIO fails unlink as well); the caller then
    checks that the next command removes them."""

    def significant(state: dict[str, str]) -> dict[str, str]:
        return {
            k: v
            for k, v in state.items()
            if not re.search(r"(^|/)\.ckvc/index(/|$)", k)
            and not (k not in before and "/packs/" in k)
            and not (temporaries_allowed and k not in before and TEMP_NAME.search(k.rsplit("/", 1)[-1]))
        }

    a, b = significant(before), significant(after)
    if a == b:
        return None
    return Verdict(FAILED, f"refused (exit {proc.rc}) but changed: {tree_diff(a, b)}")


def temp_leftovers(*roots: Path) -> list[str]:
    found = []
    for root in roots:
        if not root.exists():
            continue
        for dirpath, dirs, files in os.walk(root):
            for name in dirs + files:
                if TEMP_NAME.search(name):
                    found.append(str(Path(dirpath, name).relative_to(root)))
    return found


# ---------------------------------------------------------------------------
# States.
# ---------------------------------------------------------------------------


def _nest(kind: str, depth: int) -> Any:
    import torch

    v: Any = torch.arange(4, dtype=torch.float32)
    for i in range(depth):
        if kind == "tuple":
            v = (v, i)
        elif kind == "list":
            v = [v, i]
        elif kind == "dict":
            v = {"k": v, "i": i}
        else:
            v = collections.OrderedDict([("k", v), ("i", i)])
    return {"deep": v}


def build_state(spec: str) -> Any:
    """Deterministic states by name: 'small-K', 'deep-KIND-DEPTH', 'wide-N', 'huge-...'."""
    import numpy as np
    import torch

    kind, _, arg = spec.partition("-")
    if kind == "small":
        g = torch.Generator().manual_seed(int(arg))
        return {
            "model": {"w": torch.randn(64 << 10, generator=g), "b": torch.randn(100, generator=g)},
            "step": int(arg),
            "opt": {"lr": 1e-3, "betas": (0.9, 0.999)},
        }
    if kind == "deep":
        nest, _, depth = arg.partition("-")
        return _nest(nest, int(depth))
    if kind == "wide":
        return {f"t{i}": torch.full((2,), float(i)) for i in range(int(arg))}
    if kind == "longlist":
        return {"xs": list(range(int(arg)))}
    if kind == "bigint":
        return {"n": 1 << int(arg)}
    if kind == "longkey":
        return {"k" * int(arg): torch.zeros(1)}
    if kind == "bigstr":
        return {"s": "x" * int(arg)}
    if kind == "emptytensors":
        return {"a": torch.empty(0, 1 << 40), "b": torch.empty(0), "c": np.empty((0, 3), dtype=np.float64)}
    if kind == "scalars":
        return {
            "nan": torch.tensor([float("nan"), -0.0]),
            "z": torch.zeros((), dtype=torch.complex64),
            "bool": torch.ones(3, dtype=torch.bool),
            "bf": torch.ones(3, dtype=torch.bfloat16),
            "np": np.float16(1.5),
        }
    raise ValueError(spec)


def save_state(spec: str, path: Path) -> str:
    """torch.save the state (deep ones need a higher recursion limit to pickle); returns its digest."""
    import torch

    state = build_state(spec)
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 20000))
    try:
        torch.save(state, path)
    finally:
        sys.setrecursionlimit(old)
    return state_digest(state)


# ---------------------------------------------------------------------------
# Crafted state trees (committed by _child_craft_tree).
# ---------------------------------------------------------------------------


def _pk(value: Any) -> bytes:
    import msgpack

    return msgpack.packb(value, use_bin_type=True)


def _first_tensor_node(tree: bytes) -> tuple[Any, list[Any]]:
    """The decoded top level of a real tree (ext types raw) and its first tensor node."""
    import msgpack

    top = msgpack.unpackb(tree, raw=False, strict_map_key=False)
    for value in top.values():
        if isinstance(value, msgpack.ExtType) and value.code == 4:
            return top, msgpack.unpackb(value.data, raw=False)
    raise ValueError("no tensor node")


def _with_node(edit: Callable[[list[Any]], Any]) -> Callable[[bytes], bytes]:
    def craft(tree: bytes) -> bytes:
        import msgpack

        top, node = _first_tensor_node(tree)
        node = edit(list(node))
        return _pk({**top, "w": msgpack.ExtType(4, _pk(node))})

    return craft


def _nested_ext(code: int, depth: int) -> bytes:
    """``depth`` extension values of type ``code`` inside each other, built without recursion."""
    import msgpack

    inner = _pk([1])
    for _ in range(depth):
        inner = _pk([msgpack.ExtType(code, inner)])
    return _pk({"deep": msgpack.ExtType(code, inner)})


def _set(i: int, v: Any) -> Callable[[list[Any]], list[Any]]:
    def edit(node: list[Any]) -> list[Any]:
        node[i] = v
        return node

    return edit


def _ext(code: int, data: bytes) -> Callable[[bytes], bytes]:
    import msgpack

    return lambda tree: _pk({"x": msgpack.ExtType(code, data)})


CRAFTED_TREES: dict[str, Callable[[bytes], bytes]] = {
    "not-msgpack": lambda tree: b"\xc1\xc1\xc1",
    "truncated": lambda tree: tree[: len(tree) // 2],
    "trailing-garbage": lambda tree: tree + b"\x00\x01",
    "unknown-ext": _ext(99, b"x"),
    "unknown-dtype": _ext(3, b"float99"),
    "bad-npscalar": _ext(5, _pk(["<f8", b"\x00"])),
    "bigint-1MB": _ext(2, b"\x7f" * (1 << 20)),
    "blob-index-out-of-range": _with_node(_set(0, 7)),
    "negative-shape": _with_node(_set(1, [-4])),
    "overflow-shape": _with_node(_set(1, [1 << 40, 1 << 40])),
    "huge-shape-1e13": _with_node(_set(1, [10**13])),
    "uint64-max-shape": _with_node(_set(1, [(1 << 64) - 1])),
    "shape-larger-than-blob": _with_node(_set(1, [1000])),
    "bad-stride": _with_node(_set(2, [1 << 50])),
    "offset-past-blob": _with_node(_set(3, 1 << 40)),
    "bad-kind": _with_node(_set(4, 77)),
    "bad-device": _with_node(_set(5, "nonsense:99")),
    "short-node": _with_node(lambda node: node[:3]),
    "dtype-in-node-wrong": _with_node(_set(5, 12)),
    "deep-tuple-ext-300": lambda tree: _nested_ext(1, 300),
    "deep-odict-ext-300": lambda tree: _nested_ext(9, 300),
    "deep-tuple-ext-5000": lambda tree: _nested_ext(1, 5000),
    "deep-list-20000": lambda tree: b"\x91" * 20000 + b"\x01",
    "pickle-ext": _ext(6, b"cos\nsystem\n(S'true'\ntR."),
}


# ---------------------------------------------------------------------------
# Cases and categories.
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    category: str
    name: str
    run: Callable[[Ctx], Verdict]


@dataclasses.dataclass
class Result:
    category: str
    case: str
    verdict: str
    detail: str


class Ctx:
    """What a case needs: the runner, a fresh directory, the base repositories."""

    def __init__(self, runner: Runner, work: Path, bases: Bases, args: argparse.Namespace) -> None:
        self.runner = runner
        self.work = work
        self.bases = bases
        self.args = args
        self.keep: set[Path] = set()  # workspaces later cases reuse

    def fresh(self, base: str = "two") -> Path:
        """A copy of a base workspace (repository plus input files) in a new directory."""
        dest = Path(tempfile.mkdtemp(dir=self.work))
        shutil.copytree(self.bases.path(base), dest, dirs_exist_ok=True, symlinks=True)
        return dest

    def cli(self, argv: list[str], cwd: Path, **kw: Any) -> Proc:
        return self.runner.cli(argv, cwd, **kw)

    def verify(self, ws: Path, expected: dict[str, str], branch: str | None = "main") -> tuple[Verdict | None, Any]:
        """None when every expected commit loads bit-exact; else the verdict. Also the report."""
        proc = self.runner.run("verify", str(ws / "r"), expected, branch, cwd=ws)
        report = proc.json()
        if proc.timed_out or proc.signal is not None:
            return judge(proc, "ok"), None
        if proc.rc != 0 or report is None:
            return Verdict(INTEGRITY, f"verify could not run: {_last_error_line(proc.stderr)}"), None
        bad = {c[:12]: v for c, v in report["commits"].items() if v != "ok"}
        if bad:
            return Verdict(INTEGRITY, f"acknowledged commits not restored bit-exact: {bad}"), report
        return None, report

    def fsck_clean(self, ws: Path) -> Verdict | None:
        proc = self.cli(["-C", "r", "fsck"], ws)
        if proc.rc == 0:
            return None
        v = judge(proc, "ok", fsck=True)
        if v.verdict in (CRASH, FAILED):
            return v
        return Verdict(INTEGRITY, f"fsck not clean (exit {proc.rc}): {_last_error_line(proc.stdout + proc.stderr)}")


class Bases:
    """Base workspaces built once per run and copied per case: 'two' holds a
    repository r/ with two commits (main, tag v1 on the first, branch b), input
    files and the digests of the committed states."""

    def __init__(self, runner: Runner, root: Path) -> None:
        self.runner = runner
        self.root = root
        self.digests: dict[str, str] = {}  # commit id -> digest
        self.ids: list[str] = []
        self._built: set[str] = set()
        self._file_digests: dict[str, str] = {}

    def path(self, name: str) -> Path:
        if name not in self._built:
            getattr(self, f"_build_{name}")(self.root / name)
            self._built.add(name)
        return self.root / name

    def _commit(self, ws: Path, spec: str, message: str, *, keep: bool = True) -> str:
        """Commit a state through the library; ``keep``: it stays reachable in every base."""
        proc = self.runner.run("commit_state", str(ws / "r"), spec, message, cwd=ws)
        report = proc.json()
        if proc.rc != 0 or report is None:
            raise RuntimeError(f"base commit failed: {proc.stderr[-2000:]}")
        if keep:
            self.digests[report["commit"]] = report["digest"]
        return str(report["commit"])

    def digests_of_file(self, path: Path) -> str:
        """The digest of a torch.save input file's state (cached by name: inputs never change)."""
        import torch

        if path.name not in self._file_digests:
            self._file_digests[path.name] = state_digest(torch.load(path, weights_only=True))
        return self._file_digests[path.name]

    def _must(self, argv: list[str], ws: Path) -> Proc:
        proc = self.runner.cli(argv, ws)
        if proc.rc != 0:
            raise RuntimeError(f"base setup {argv} failed: {proc.stderr[-2000:]}")
        return proc

    def _build_two(self, ws: Path) -> None:
        ws.mkdir(parents=True)
        self._must(["init", "r"], ws)
        first = self._commit(ws, "small-1", "first")
        self._must(["-C", "r", "tag", "v1", first], ws)
        self._must(["-C", "r", "branch", "b", first], ws)
        self.ids = [first, self._commit(ws, "small-2", "second")]
        for k in (3, 4, 5, 6):
            save_state(f"small-{k}", ws / f"s{k}.pt")

    def _build_gc(self, ws: Path) -> None:
        """'two' plus a deleted branch's commits, so gc has packs to rewrite and remove."""
        shutil.copytree(self.path("two"), ws, symlinks=True)
        self._must(["-C", "r", "branch", "doomed", "main"], ws)
        self._must(["-C", "r", "checkout", "doomed"], ws)
        self._commit(ws, "small-7", "doomed 1", keep=False)
        self._commit(ws, "small-8", "doomed 2", keep=False)
        self._must(["-C", "r", "checkout", "main"], ws)
        self._must(["-C", "r", "branch", "-D", "doomed"], ws)

    def _build_dirs(self, ws: Path) -> None:
        """'two' plus a model folder committed twice (v-dir1, v-dir2), for checkout -o DIR."""
        import torch
        from safetensors.torch import save_file

        shutil.copytree(self.path("two"), ws, symlinks=True)
        for k in (1, 2):
            src = ws / f"model{k}"
            src.mkdir()
            g = torch.Generator().manual_seed(k)
            for shard in range(3):
                save_file({"w": torch.randn(128 << 10, generator=g)}, str(src / f"model-{shard}.safetensors"))
            (src / "config.json").write_text(json.dumps({"k": k}))
            if k == 1:
                (src / "only-in-1.json").write_text("{}")
            commit = self._must(["-C", "r", "commit", f"../model{k}", "-m", f"dir {k}", "--json"], ws).json()
            self._must(["-C", "r", "tag", f"v-dir{k}", commit["commit"]], ws)
        # Reference checkouts, to tell a whole output directory from a mixed one.
        for k in (1, 2):
            self._must(["-C", "r", "checkout", f"v-dir{k}", "-o", f"../ref{k}"], ws)
        self._must(["-C", "r", "checkout", "main"], ws)


def has_command(ctx: Ctx, name: str) -> bool:
    return ctx.cli([name, "--help"], ctx.bases.path("two")).rc == 0


# ---- category: crafted inputs to every CLI command ------------------------

NONUTF8 = b"\xff\xfe-name".decode("utf-8", "surrogateescape")
HUGE = str(10**30)
REVS = {
    "empty": "",
    "nonutf8": NONUTF8,
    "huge-ancestor": f"HEAD~{HUGE}",
    "negative-ancestor": "HEAD~-1",
    "many-carets": "HEAD" + "^" * 5000,
    "long": "a" * 100_000,
    "dotdot": "../../etc/passwd",
    "reflog-syntax": "main@{1}",
    "newline": "main\nx",
    "short-prefix": "0",
    "pruned-or-missing-id": "f" * 64,
}
# Ref names and whether creating them must be refused ("err") or may go either way.
NAMES = {
    "empty": ("", "err"),
    "dotdot": ("a..b", "err"),
    "lock": ("x.lock", "err"),
    "dash": ("-x", "err"),
    "slash-end": ("x/", "err"),
    "long-300": ("n" * 300, "any"),
    "nonutf8": (NONUTF8, "any"),
    "space": ("a b", "any"),
    "at-brace": ("a@{b", "err"),
    "HEAD": ("HEAD", "err"),
    "unicode": ("héllo-ß", "any"),
    "nested": ("a/b/c", "any"),
    "existing-branch": ("b", "any"),
    "existing-tag": ("v1", "any"),
    "escape": ("../../outside", "err"),
}


def _fixture(ws: Path, name: str) -> str:
    """Create an odd input in ws and return its path relative to ws/r."""
    p = ws / name
    if name == "fifo":
        os.mkfifo(p)
    elif name == "empty.pt":
        p.write_bytes(b"")
    elif name == "garbage.pt":
        p.write_bytes(random.Random(5).randbytes(4096))
    elif name == "truncated.pt":
        data = (ws / "s3.pt").read_bytes()
        p.write_bytes(data[: len(data) // 2])
    elif name == "empty-dir":
        p.mkdir()
    elif name == "dir-with-fifo":
        p.mkdir()
        shutil.copy(ws / "s3.pt", p / "model.pt")
        os.mkfifo(p / "pipe.bin")
    elif name == "dir-with-link-out":
        p.mkdir()
        shutil.copy(ws / "s3.pt", p / "model.pt")
        os.symlink("/etc/passwd", p / "passwd.txt")
    elif name == "dir-with-linked-subdir":
        p.mkdir()
        (ws / "shards").mkdir()
        shutil.copy(ws / "s3.pt", ws / "shards" / "model.pt")
        (p / "config.json").write_text("{}")
        os.symlink("../shards", p / "weights")
    elif name == "dir-link-loop":
        p.mkdir()
        shutil.copy(ws / "s3.pt", p / "model.pt")
        os.symlink(".", p / "loop")
    elif name == "nonutf8" + ".pt":
        shutil.copy(ws / "s3.pt", ws / (NONUTF8 + ".pt"))
        return "../" + NONUTF8 + ".pt"
    elif name == "a-file":
        p.write_text("x")
    elif name == "pickle.pt":
        import torch

        torch.save({"f": functools.partial(print, 1)}, p)
    elif name == "safetensors-garbage.safetensors":
        p.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    elif name == "safetensors-huge-header.safetensors":
        p.write_bytes(struct.pack("<Q", 90_000_000) + b'{"a":' + b" " * 1000)
    return "../" + name


def cli_cases(args: argparse.Namespace) -> Iterator[tuple[str, list[str], str, list[str]]]:
    """(name, argv run in ws/r, expectation, fixtures)."""
    for key, rev in REVS.items():
        for cmd in (["log"], ["show"], ["checkout"], ["diff", "HEAD"], ["reflog"], ["branch", "new"], ["tag", "t"]):
            expect = "any" if key in ("short-prefix", "reflog-syntax") else "err"
            yield f"{cmd[0]} rev={key}", [*cmd, rev], expect, []
    for key, (name, expect) in NAMES.items():
        yield f"branch name={key}", ["branch", name], "err" if key == "existing-branch" else expect, []
        yield f"tag name={key}", ["tag", name], "err" if key == "existing-tag" else expect, []
        yield f"branch -d name={key}", ["branch", "-d", name], "any" if key == "existing-branch" else "err", []
        yield f"init --default-branch={key}", ["init", "sub", "--default-branch", name], expect, []
    for fixture, expect in (
        ("fifo", "err"),
        ("empty.pt", "err"),
        # A file that does not parse (or needs pickle) is stored as its bytes, as in a
        # folder (ckvc.formats, issue 13): never unpickled, never refused.
        ("garbage.pt", "ok"),
        ("truncated.pt", "ok"),
        ("empty-dir", "ok"),  # an empty folder is a state like any other (ckvc.formats)
        ("dir-with-fifo", "any"),
        ("dir-with-link-out", "any"),
        ("dir-with-linked-subdir", "any"),
        ("dir-link-loop", "any"),
        ("nonutf8.pt", "ok"),
        ("pickle.pt", "ok"),
        ("safetensors-garbage.safetensors", "ok"),
        ("safetensors-huge-header.safetensors", "ok"),
    ):
        yield f"commit {fixture}", ["commit", "{0}", "-m", "x"], expect, [fixture]
    for path, expect in (("/dev/zero", "err"), ("/dev/null", "err"), ("/proc/self/environ", "err"), ("/", "err")):
        yield f"commit {path}", ["commit", path], expect, []
    for opts, expect in (
        (["-m", NONUTF8], "any"),
        (["--metric", "loss=nan"], "any"),
        (["--metric", "loss=1e999"], "any"),
        (["--metric", "loss"], "err"),
        (["--metric", f"{NONUTF8}=1"], "any"),
        (["--meta", f"k={NONUTF8}"], "any"),
        (["--lossy", "bogus"], "err"),
        (["--lossy", "x=bogus"], "err"),
        (["-m", "x" * 1_000_000], "any"),
    ):
        yield f"commit {' '.join(opts)[:40]}", ["commit", "../s3.pt", *opts], expect, []
    for target, expect in (
        ("/proc/self/nope.pt", "err"),
        ("../a-file/under.pt", "err"),
        ("../" + "n" * 300 + ".pt", "err"),
        ("/dev/full", "err"),
        ("..", "err"),
        ("../out.unknownext", "any"),
        (f"../{NONUTF8}.pt", "any"),
        ("", "err"),
    ):
        yield f"checkout -o {target[:40]}", ["checkout", "main", "-o", target], expect, ["a-file"]
    for opts in (["-n", "-1"], ["-n", HUGE], ["-n", "x"], ["--oneline", "-n", "0"]):
        yield f"log {' '.join(opts)[:40]}", ["log", *opts], "any", []
    for opts in (
        ["--level", "bogus"],
        ["--sample", "200%"],
        ["--sample", "abc"],
        ["--sample", "-1%"],
        ["--sample", "0%"],
        ["--level", "refs"],
    ):
        yield f"fsck {' '.join(opts)}", ["fsck", *opts], "any", []
    for key, value in (
        ("codec", "zstd:1000"),
        ("codec", "bogus"),
        ("chunk_size", "-1"),
        ("chunk_size", "0"),
        ("chunk_size", HUGE),
        ("chunk_size", "abc"),
        ("keyframe_interval", "0"),
        ("keyframe_interval", "abc"),
        ("nonsense_key", "1"),
        (NONUTF8, "1"),
        ("format_version", "99"),
    ):
        yield f"config {key[:20]} {value[:20]}", ["config", key, value], "err", []
    for opts in (
        ["--keep-last", "-1"],
        ["--keep-best", "bad"],
        ["--keep-best", "loss:min:-2"],
        ["--keep-within", "abc"],
        ["--keep-every", "0"],
        ["--keep-last", HUGE],
    ):
        yield f"retain {' '.join(opts)[:40]}", ["retain", *opts, "--dry-run"], "any", []
    for opts in (["--grace", "abc"], ["--grace", "-1s"], ["--grace", HUGE + "d"]):
        yield f"gc {' '.join(opts)[:40]}", ["gc", *opts], "any", []
    for opts, expect in (
        (["init"], "ok"),  # an existing repository: "Reinitialized", as git (issue 13)
        (["init", "x", "--chunk-size", "0"], "err"),
        (["init", "x", "--chunk-size", "-1"], "err"),
        (["init", "x", "--chunk-size", HUGE], "err"),
        (["init", "../a-file"], "err"),
        (["init", "/proc/nope"], "err"),
        (["-C", "/nonexistent", "log"], "err"),
        (["-C", "../a-file", "log"], "err"),
        (["-C", "/", "log"], "err"),
        (["diff", "v1", "v1"], "ok"),
        (["diff", "HEAD", "b"], "ok"),
        (["du", "--json"], "ok"),
        (["status"], "ok"),
        (["reflog", "refs/heads/nope"], "err"),
    ):
        yield f"misc {' '.join(opts)[:40]}", opts, expect, ["a-file"]


def cli_category(ctx: Ctx) -> Iterator[Case]:
    def make(name: str, argv: list[str], expect: str, fixtures: list[str]) -> Case:
        def run(ctx: Ctx) -> Verdict:
            ws = ctx.fresh()
            paths = [_fixture(ws, f) for f in fixtures]
            full = ["-C", "r", *[paths[0] if a == "{0}" else a for a in argv]]
            before = tree_state(ws)
            proc = ctx.cli(full, ws, timeout=ctx.args.timeout)
            verdict = judge(proc, expect)
            if verdict.verdict == HANDLED and proc.rc != 0:
                return unchanged(before, tree_state(ws), proc) or verdict
            return verdict

        return Case("cli", name, run)

    for spec in cli_cases(ctx.args):
        yield make(*spec)


# ---- category: crafted objects, packs, index, config, refs, logs ----------


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 1 << (offset % 8)
    path.write_bytes(bytes(data))


def _index_file(repo: Path) -> Path:
    return next(repo.rglob("data.mdb"))


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


Mutation = Callable[[Path], object]


def _in_pack(c: Path, which: str, edit: Callable[[Path], object]) -> None:
    packs = [p for p in (c / "packs").iterdir() if p.is_file()]
    edit((max if which == "largest" else min)(packs, key=lambda p: p.stat().st_size))


def _truncate(path: Path, fraction: float) -> None:
    os.truncate(path, int(path.stat().st_size * fraction))


def _write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def _remove(path: Path) -> None:
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def _stray_ref(c: Path, name: str) -> None:
    (c / "refs" / "heads" / name).write_text(_tip(c) + "\n")


def _replace_by_file(path: Path) -> None:
    shutil.rmtree(path)
    path.write_text("x")


def _append_logs(c: Path, line: bytes) -> None:
    for p in (c / "logs").rglob("*"):
        if p.is_file():
            _append(p, line)


def _craft_toc(pack: Path, field: int, value: int) -> None:
    """Set ``field`` of every TOC entry to ``value``, with the TOC's CRC recomputed
    (a malicious pack, not a damaged one: the checksums hold)."""
    import zlib

    from ckvc.storage.packs import FOOTER, TOC_ENTRY, TOC_HEADER

    data = bytearray(pack.read_bytes())
    end = len(data) - FOOTER.size
    magic, toc_offset, count, _crc, reserved = FOOTER.unpack_from(data, end)
    for i in range(count):
        at = toc_offset + TOC_HEADER.size + i * TOC_ENTRY.size
        entry = list(TOC_ENTRY.unpack_from(data, at))
        entry[field] = value
        TOC_ENTRY.pack_into(data, at, *entry)
    FOOTER.pack_into(data, end, magic, toc_offset, count, zlib.crc32(data[toc_offset:end]), reserved)
    pack.write_bytes(bytes(data))


def _craft_record(pack: Path, field: int, value: int) -> None:
    """Set ``field`` of the first record's header to ``value``, with its CRC recomputed."""
    import zlib

    from ckvc.storage.packs import PACK_HEADER, RECORD_HEADER

    data = bytearray(pack.read_bytes())
    header = list(RECORD_HEADER.unpack_from(data, PACK_HEADER.size))
    header[field] = value
    RECORD_HEADER.pack_into(data, PACK_HEADER.size, *header)
    fixed = data[PACK_HEADER.size : PACK_HEADER.size + RECORD_HEADER.size]
    struct.pack_into("<I", data, PACK_HEADER.size + RECORD_HEADER.size, zlib.crc32(fixed))
    pack.write_bytes(bytes(data))


def _and_no_index(mutate: Mutation) -> Mutation:
    """``mutate``, then the index removed, so it is rebuilt from the crafted pack."""

    def both(c: Path) -> None:
        mutate(c)
        shutil.rmtree(_index_file(c).parent)

    return both


def _on(path: str, edit: Callable[..., object], *args: Any) -> Mutation:
    """A mutation applying ``edit(file, *args)`` to .ckvc/``path``; ``index``: the LMDB data file."""

    def mutate(c: Path) -> None:
        target = _index_file(c) if path == "index" else _config_file(c) if path == "config" else c / path
        edit(target, *args)

    return mutate


P = functools.partial


def repo_mutations(rng: random.Random, long: bool) -> Iterator[tuple[str, Mutation]]:
    """(name, mutate(.ckvc dir)). Bit flips and truncations at seeded offsets."""
    for _ in range(40 if long else 4):
        off = rng.randrange(1 << 30)
        yield f"pack-bitflip-large@{off}", P(_in_pack, which="largest", edit=P(_flip, offset=off))
        yield f"pack-bitflip-small@{off}", P(_in_pack, which="smallest", edit=P(_flip, offset=off))
    for frac in (0.0, 0.3, 0.9, 0.999) if long else (0.5,):
        yield f"pack-truncate-{frac}", P(_in_pack, which="largest", edit=P(_truncate, fraction=frac))
        yield f"index-truncate-{frac}", _on("index", _truncate, frac)
    yield "pack-garbage", P(_in_pack, which="largest", edit=P(_write, data=random.Random(1).randbytes(5000)))
    yield "pack-append-garbage", P(_in_pack, which="largest", edit=P(_append, data=b"\x00garbage" * 10))
    yield "pack-huge-footer-size", P(_in_pack, which="smallest", edit=P(_append, data=b"\xff" * 64))
    huge = 1 << 50
    for which in ("largest", "smallest"):
        yield (
            f"toc-raw-size-huge-{which}",
            _and_no_index(P(_in_pack, which=which, edit=P(_craft_toc, field=6, value=huge))),
        )
        yield (
            f"toc-record-size-huge-{which}",
            _and_no_index(P(_in_pack, which=which, edit=P(_craft_toc, field=5, value=huge))),
        )
        yield (
            f"toc-offset-huge-{which}",
            _and_no_index(P(_in_pack, which=which, edit=P(_craft_toc, field=4, value=huge))),
        )
        yield f"record-raw-size-huge-{which}", P(_in_pack, which=which, edit=P(_craft_record, field=4, value=huge))
        yield f"record-payload-size-huge-{which}", P(_in_pack, which=which, edit=P(_craft_record, field=5, value=huge))
    yield "index-garbage", _on("index", _write, random.Random(2).randbytes(64 << 10))
    yield "index-empty", _on("index", _write, b"")
    yield "index-deleted", _on("index", lambda p: shutil.rmtree(p.parent))
    for key, value in (
        ("chunk_size", "abc"),
        ("chunk_size", -1),
        ("chunk_size", 1 << 70),
        ("codec", {"name": "zstd", "level": 1000}),
        ("codec", "zstd"),
        ("format_version", 999),
        ("keyframe_interval", "x"),
        ("default_branch", 5),
    ):
        yield f"config {key}={value!r}"[:60], _on("config", _edit_config, key, value)
    yield "config-garbage", _on("config", _write, b"\xff\x00{{{")
    yield "config-empty", _on("config", _write, b"")
    yield "config-deleted", _on("config", _remove)
    for name in ("main.lock", ".hidden", "a..b", "bad name", NONUTF8):
        yield f"stray-ref {name!r}"[:40], P(_stray_ref, name=name)
    yield "stray-ref-dir-lock", _on("refs/heads/x.lock", Path.mkdir)
    yield "ref-garbage", _on("refs/heads/b", _write, b"\xff\xfenot an id\n")
    yield "ref-empty", _on("refs/heads/b", _write, b"")
    yield "ref-missing-object", _on("refs/heads/b", _write, b"ab" * 32 + b"\n")
    yield "main-missing-object", _on("refs/heads/main", _write, b"cd" * 32 + b"\n")
    yield "tag-missing-object", _on("refs/tags/v1", _write, b"ef" * 32 + b"\n")
    yield "HEAD-garbage", _on("HEAD", _write, b"\x00\xff garbage")
    yield "HEAD-to-missing-branch", _on("HEAD", _write, b"ref: refs/heads/nope\n")
    yield "HEAD-escape", _on("HEAD", _write, b"ref: ../../../etc/passwd\n")
    yield "ref-symlink-loop", _on("refs/heads/b2", lambda p: os.symlink("b2", p))
    yield "refs-dir-replaced-by-file", _on("refs/tags", _replace_by_file)
    yield "pruned-bad-line", _on("pruned.jsonl", _append, b"{not json\n")
    yield "pruned-nonutf8", _on("pruned.jsonl", _append, b"\xff\xfe\n")
    yield "pruned-wrong-types", _on("pruned.jsonl", _append, b'{"commit": 5, "policy": [], "time_ns": "x"}\n')
    yield "reflog-bad-line", P(_append_logs, line=b"garbage line\n")
    yield "reflog-nonutf8", P(_append_logs, line=b"\xff\xfe\xfd\n")
    yield "reflog-torn", P(_append_logs, line=b"0" * 30)


def _config_file(c: Path) -> Path:
    return next(p for p in c.iterdir() if p.name.startswith("config"))


def _edit_config(path: Path, key: str, value: Any) -> None:
    data = json.loads(path.read_text())
    data[key] = value
    path.write_text(json.dumps(data))


def _tip(c: Path) -> str:
    return (c / "refs" / "heads" / "main").read_text().strip()


# Commands run on a damaged repository: (name, argv, expectation on a healthy repo).
DAMAGED_COMMANDS = (
    ("log", ["log"]),
    ("show", ["show"]),
    ("checkout-o", ["checkout", "{tip}", "-o", "../out.pt"]),
    ("fsck", ["fsck"]),
    ("fsck-rebuild", ["fsck", "--rebuild-index"]),
    ("commit", ["commit", "../s3.pt", "-m", "after damage"]),
    ("branch", ["branch"]),
    ("reflog", ["reflog"]),
    ("gc", ["gc", "--now"]),
    ("du", ["du"]),
    ("status", ["status"]),
)
SHORT_DAMAGED = ("show", "checkout-o", "fsck", "commit", "log")


def crafted_category(ctx: Ctx) -> Iterator[Case]:
    commands = [c for c in DAMAGED_COMMANDS if ctx.args.long or c[0] in SHORT_DAMAGED]

    def make(mname: str, mutate: Mutation, cname: str, argv: list[str]) -> Case:
        def run(ctx: Ctx) -> Verdict:
            ws = ctx.fresh()
            mutate(ws / "r" / ".ckvc")
            before = tree_state(ws)
            proc = ctx.cli(["-C", "r", *[ctx.bases.ids[-1] if a == "{tip}" else a for a in argv]], ws)
            v = judge(proc, "any", fsck=cname.startswith("fsck"))
            if v.verdict != HANDLED:
                return v
            if proc.rc != 0 and not cname.startswith("fsck") and (bad := unchanged(before, tree_state(ws), proc)):
                return bad
            if cname == "checkout-o" and proc.rc == 0:
                return _check_output(ctx, ws)
            return v

        return Case("crafted", f"{mname}: {cname}", run)

    def cross(mname: str, mutate: Mutation) -> Case:
        """Whatever load refuses, fsck must report: checkout of every commit, then fsck."""

        def run(ctx: Ctx) -> Verdict:
            ws = ctx.fresh()
            mutate(ws / "r" / ".ckvc")
            refused = []
            for rev in ctx.bases.ids:
                proc = ctx.cli(["-C", "r", "checkout", rev, "-o", "../x.pt"], ws)
                if judge(proc, "ok").verdict != HANDLED and proc.rc in (4, 6, 7, 22):
                    refused.append(f"{rev[:12]} (exit {proc.rc})")
            fsck = ctx.cli(["-C", "r", "fsck", "--level", "full"], ws)
            if refused and fsck.rc == 0:
                return Verdict(FAILED, f"fsck clean but load refuses {', '.join(refused)}")
            return judge(fsck, "any", fsck=True)

        return Case("crafted", f"{mname}: load-refuses=>fsck-reports", run)

    for mname, mutate in repo_mutations(random.Random(ctx.args.seed), ctx.args.long):
        for cname, argv in commands:
            yield make(mname, mutate, cname, argv)
        if mname.startswith("pack"):
            yield cross(mname, mutate)
    for craft in CRAFTED_TREES:
        yield from crafted_tree_cases(craft, commands)


def _check_output(ctx: Ctx, ws: Path) -> Verdict:
    """A checkout of main's tip that succeeded must have written its exact bytes."""
    import torch

    expected = ctx.bases.digests[ctx.bases.ids[-1]]
    got = state_digest(torch.load(ws / "out.pt", weights_only=True))
    return Verdict(HANDLED) if got == expected else Verdict(INTEGRITY, "checkout -o wrote wrong bytes")


def crafted_tree_cases(craft: str, commands: list[tuple[str, list[str]]]) -> Iterator[Case]:
    """A commit whose state tree is CRAFTED_TREES[craft]: every read refuses it or
    reads it, nothing crashes, and if load refuses, fsck reports it."""

    def run_command(cname: str, argv: list[str]) -> Callable[[Ctx], Verdict]:
        def run(ctx: Ctx) -> Verdict:
            ws = ctx.fresh()
            made = ctx.runner.run("craft_tree", str(ws / "r"), craft, cwd=ws)
            if made.rc != 0:  # the write path refused it: fine, if typed
                return judge(made, "any")
            proc = ctx.cli(["-C", "r", *argv], ws)
            return judge(proc, "any", fsck=cname.startswith("fsck"))

        return run

    def cross(ctx: Ctx) -> Verdict:
        ws = ctx.fresh()
        made = ctx.runner.run("craft_tree", str(ws / "r"), craft, cwd=ws)
        if made.rc != 0:
            return judge(made, "any")
        load = ctx.cli(["-C", "r", "checkout", "HEAD", "-o", "../x.pt"], ws)
        if (v := judge(load, "any")).verdict != HANDLED:
            return v
        fsck = ctx.cli(["-C", "r", "fsck", "--level", "metadata"], ws)
        if (v := judge(fsck, "any", fsck=True)).verdict != HANDLED:
            return v
        if load.rc != 0 and fsck.rc == 0:
            return Verdict(FAILED, f"load refuses (exit {load.rc}) but fsck --level metadata is clean")
        return Verdict(HANDLED)

    for cname, argv in commands:
        if cname in ("show", "checkout-o", "fsck", "log", "du", "gc"):
            yield Case("crafted", f"tree {craft}: {cname}", run_command(cname, argv))
    yield Case("crafted", f"tree {craft}: load-refuses=>fsck-reports", cross)


# ---- category: fault injection in commit and gc ---------------------------

FAULT_MODES = (
    ("once", errno_mod.EIO),
    ("persist", errno_mod.ENOSPC),
    ("once", errno_mod.ENOSPC),
    ("persist", errno_mod.EIO),
)


def fault_category(ctx: Ctx) -> Iterator[Case]:
    ops = {
        "commit": ("two", ["-C", "r", "commit", "../s3.pt", "-m", "faulted", "--json"]),
        "gc": ("gc", ["-C", "r", "gc", "--now"]),
        "tag": ("two", ["-C", "r", "tag", "faulted"]),
        "retain": ("two", ["-C", "r", "retain", "--keep-last", "1"]),
    }
    if ctx.args.quick:  # each op costs a counting run before any case: two ops for two cases
        ops = {op: ops[op] for op in ("commit", "gc")}
    rng = random.Random(ctx.args.seed + 1)
    for op, (base, argv) in ops.items():
        ws = ctx.fresh(base)
        record = ws / "calls.txt"
        proc = ctx.cli(
            argv, ws, faults={"k": 0, "persist": False, "errno": 0, "record": str(record)}, env={"CKVC_THREADS": "1"}
        )
        if proc.rc != 0:
            yield Case("faults", f"{op}: counting run", P(_judged, proc))
            continue
        calls = record.read_text().splitlines()
        modes = FAULT_MODES if ctx.args.long else FAULT_MODES[:2]
        for mode, err in modes:
            ks = list(range(1, len(calls) + 1))
            if not ctx.args.long:
                ks = sorted(rng.sample(ks, min(len(ks), 8)))
            for k in ks:
                name = f"{op} {mode} {errno_mod.errorcode[err]} at call {k}/{len(calls)} ({calls[k - 1]})"
                yield Case(
                    "faults", name, functools.partial(_fault_case, base=base, argv=argv, k=k, mode=mode, err=err, op=op)
                )


def _judged(proc: Proc, ctx: Ctx) -> Verdict:
    return judge(proc, "ok")


def _fault_case(ctx: Ctx, *, base: str, argv: list[str], k: int, mode: str, err: int, op: str) -> Verdict:
    ws = ctx.fresh(base)
    expected = dict(ctx.bases.digests)
    before_tip = _read_tip(ws)
    before = tree_state(ws)
    faults = {"k": k, "persist": mode == "persist", "errno": err, "record": None}
    proc = ctx.cli(argv, ws, faults=faults, env={"CKVC_THREADS": "1"})
    v = judge(proc, "any")
    if v.verdict == CRASH:
        return v
    tip = _read_tip(ws)
    if proc.rc == 0 and op == "commit":
        made = (proc.json() or {}).get("commit")
        if made != tip:
            return Verdict(INTEGRITY, f"commit acknowledged ({str(made)[:12]}) but main is {str(tip)[:12]}")
        expected[str(tip)] = ctx.bases.digests_of_file(ws / "s3.pt")
    elif proc.rc != 0:
        if tip != before_tip:
            return Verdict(FAILED, f"failed (exit {proc.rc}) after main moved: {_last_error_line(proc.stderr)}")
        unlink_fails = mode == "persist" and err != errno_mod.ENOSPC  # see _install_faults
        if v.verdict == HANDLED and (bad := unchanged(before, tree_state(ws), proc, temporaries_allowed=unlink_fails)):
            return bad
    # The next command, unfaulted, must work and clean up after the failed one.
    nxt = ctx.cli(["-C", "r", "commit", "../s4.pt", "-m", "next"], ws)
    if nxt.rc != 0:
        return Verdict(FAILED, f"next commit after the fault fails: {judge(nxt, 'ok').detail}")
    if (bad := ctx.fsck_clean(ws)) is not None:
        return bad
    bad, _ = ctx.verify(ws, expected)
    if bad is not None:
        return bad
    if left := temp_leftovers(ws / "r"):
        return Verdict(INTEGRITY, f"temporary files left after the next command: {left[:3]}")
    return v


def _read_tip(ws: Path, branch: str = "main") -> str | None:
    try:
        return (ws / "r" / ".ckvc" / "refs" / "heads" / branch).read_text().strip()
    except OSError:
        return None


# ---- category: disk full on a real tmpfs ----------------------------------


@contextlib.contextmanager
def small_tmpfs(where: Path, size: int) -> Iterator[Path | None]:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _fill(mount: Path, leave: int) -> None:
    st = os.statvfs(mount)
    free = st.f_bavail * st.f_frsize
    with open(mount / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))
        f.flush()
        os.fsync(f.fileno())


def diskfull_category(ctx: Ctx) -> Iterator[Case]:
    levels = 24 if ctx.args.long else 6
    step = 48 << 10
    ops = {"commit": ["-C", "r", "commit", "../s3.pt", "-m", "full", "--json"], "gc": ["-C", "r", "gc", "--now"]}
    for op, argv in ops.items():
        for i in range(levels):
            leave = i * step
            yield Case(
                "diskfull",
                f"{op} with {leave >> 10} KiB free",
                functools.partial(_diskfull_case, op=op, argv=argv, leave=leave),
            )


def _diskfull_case(ctx: Ctx, *, op: str, argv: list[str], leave: int) -> Verdict:
    base = ctx.bases.path("gc" if op == "gc" else "two")
    mount_at = Path(tempfile.mkdtemp(dir=ctx.work))
    with small_tmpfs(mount_at, 6 << 20) as mount:
        if mount is None:
            return Verdict("skip", "cannot mount a tmpfs (not root?)")
        shutil.copytree(base, mount, dirs_exist_ok=True, symlinks=True)
        expected = dict(ctx.bases.digests)
        before_tip = _read_tip(mount)
        _fill(mount, leave)
        proc = ctx.cli(argv, mount)
        v = judge(proc, "any")
        if v.verdict == CRASH:
            return v
        if proc.rc not in (0, None) and proc.rc != 19 and v.verdict == HANDLED:
            v = Verdict(
                FAILED,
                f"disk full reported as exit {proc.rc}, not StorageFullError (19): {_last_error_line(proc.stderr)}",
            )
        tip = _read_tip(mount)
        if proc.rc == 0 and op == "commit":
            expected[tip] = ctx.bases.digests_of_file(mount / "s3.pt")  # type: ignore[index]
        elif proc.rc != 0 and tip != before_tip:
            return Verdict(FAILED, f"failed (exit {proc.rc}) after main moved")
        (mount / "filler").unlink()
        nxt = ctx.cli(["-C", "r", "commit", "../s4.pt", "-m", "after space freed"], mount)
        if nxt.rc != 0:
            return Verdict(FAILED, f"next commit after freeing space fails: {judge(nxt, 'ok').detail}")
        if (bad := ctx.fsck_clean(mount)) is not None:
            return bad
        bad, _ = ctx.verify(mount, expected)
        if bad is not None:
            return bad
        if left := temp_leftovers(mount / "r"):
            return Verdict(INTEGRITY, f"temporary files left after the next command: {left[:3]}")
        return v


# ---- category: a read-only repository --------------------------------------

# (name, argv, expectation): reads work, writes give one typed error.
READONLY_COMMANDS = (
    ("log", ["log"], "ok"),
    ("show", ["show"], "ok"),
    ("show v1", ["show", "v1"], "ok"),
    ("diff", ["diff", "v1", "main"], "ok"),
    ("checkout -o elsewhere", ["checkout", "v1", "-o", "{out}/v1.pt"], "ok"),
    ("fsck", ["fsck"], "ok"),
    ("fsck --level metadata", ["fsck", "--level", "metadata"], "ok"),
    ("du", ["du"], "ok"),
    ("status", ["status"], "ok"),
    ("branch list", ["branch"], "ok"),
    ("reflog", ["reflog"], "ok"),
    ("commit", ["commit", "{out}/../s3.pt", "-m", "ro"], "err"),
    ("branch create", ["branch", "new"], "err"),
    ("tag create", ["tag", "t2"], "err"),
    ("gc", ["gc", "--now"], "err"),
    ("config set", ["config", "keyframe_interval", "4"], "err"),
    ("retain", ["retain", "--keep-last", "1"], "err"),
    ("fsck --rebuild-index", ["fsck", "--rebuild-index"], "err"),
)


@contextlib.contextmanager
def readonly_bind(src: Path, where: Path) -> Iterator[Path | None]:
    """``src`` mounted read-only at ``where`` (a bind mount), or None when mounting is not allowed."""
    where.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "--bind", str(src), str(where)], capture_output=True).returncode != 0:
        yield None
        return
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(where)], capture_output=True).returncode != 0:
            yield None
        else:
            yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def readonly_category(ctx: Ctx) -> Iterator[Case]:
    for name, argv, expect in READONLY_COMMANDS:
        yield Case("readonly", name, P(_readonly_case, argv=argv, expect=expect))


def _readonly_case(ctx: Ctx, *, argv: list[str], expect: str) -> Verdict:
    ws = ctx.fresh()
    out = ws / "out"
    out.mkdir()
    with readonly_bind(ws / "r", ws / "ro") as ro:
        if ro is None:
            return Verdict("skip", "cannot make a read-only bind mount (not root?)")
        before = tree_state(ro)
        proc = ctx.cli(["-C", "ro", *[a.format(out=out) for a in argv]], ws)
        v = judge(proc, expect, fsck=argv[0] == "fsck")
        if v.verdict == HANDLED and proc.rc not in (0, 2, 21) and argv[0] != "fsck":
            v = Verdict(
                FAILED,
                f"refused with exit {proc.rc}, not ReadOnlyRepositoryError (21): {_last_error_line(proc.stderr)}",
            )
        if v.verdict == HANDLED and argv[0] == "checkout" and proc.rc == 0:
            import torch

            got = state_digest(torch.load(out / "v1.pt", weights_only=True))
            if got != ctx.bases.digests[ctx.bases.ids[0]]:
                return Verdict(INTEGRITY, "checkout -o from a read-only repository wrote wrong bytes")
        if tree_state(ro) != before:  # cannot happen on a read-only mount; a sanity check of the mount
            return Verdict(FAILED, "the read-only mount changed")
        return v


# ---- category: SIGKILL / SIGINT at random instants ------------------------


def signal_category(ctx: Ctx) -> Iterator[Case]:
    """``--kills`` SIGKILLs spread over the operations, and a third as many SIGINTs."""
    ops = ["commit", "gc", "checkout-dir"]
    if has_command(ctx, "export"):
        ops.append("export")
    rng = random.Random(ctx.args.seed + 2)
    per_op = -(-ctx.args.kills // len(ops))
    for op in ops:
        for i in range(per_op + per_op // 3):
            sig = signal.SIGKILL if i < per_op else signal.SIGINT
            frac = rng.random() * 1.1
            yield Case(
                "signals",
                f"{op} {sig.name} at {frac:.3f} of its run",
                functools.partial(_signal_case, op=op, sig=sig, frac=frac),
            )


def _signal_argv(op: str, round_: int) -> list[str]:
    if op == "commit":
        return ["-C", "r", "commit", f"../s{3 + round_ % 4}.pt", "-m", "sig", "--json"]
    if op == "gc":
        return ["-C", "r", "gc", "--now"]
    if op == "checkout-dir":
        return ["-C", "r", "checkout", f"v-dir{1 + round_ % 2}", "-o", "../out"]
    return ["-C", "r", "export", f"v-dir{1 + round_ % 2}", "../out"]


_durations: dict[str, float] = {}


def _signal_case(ctx: Ctx, *, op: str, sig: signal.Signals, frac: float) -> Verdict:
    base = "dirs" if op in ("checkout-dir", "export") else "gc" if op == "gc" else "two"
    ws = ctx.fresh(base)
    expected = dict(ctx.bases.digests)
    if op in ("checkout-dir", "export"):  # an older checkout is there, as in the issue
        first = ctx.cli(_signal_argv(op, 0), ws)
        if first.rc != 0:
            return judge(first, "ok")
    if op not in _durations:
        probe = ctx.fresh(base)
        if op in ("checkout-dir", "export"):
            ctx.cli(_signal_argv(op, 0), probe)
        _durations[op] = ctx.cli(_signal_argv(op, 1), probe).seconds
    before_tip = _read_tip(ws)
    pid, finish = ctx.runner.start("cli", _signal_argv(op, 1), cwd=ws)
    time.sleep(_durations[op] * frac)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    done = finish(None)
    if done.timed_out:
        return Verdict(CRASH, "hang after the signal")
    tip = _read_tip(ws)
    if sig == signal.SIGINT and done.signal is None:
        v = judge(done, "any")
        if v.verdict != HANDLED:
            return v
        if done.rc not in (0, 130):
            said = (done.stderr or "").strip().splitlines()
            return Verdict(FAILED, f"Ctrl-C gave exit {done.rc}: {said[-1] if said else 'nothing on stderr'}")
        if op == "commit" and done.rc != 0 and tip != before_tip and tip[:12] not in done.stderr:  # type: ignore[index]
            return Verdict(FAILED, f"exit {done.rc} after Ctrl-C but the commit landed (message does not say so)")
    if op == "commit" and done.rc == 0:
        made = (done.json() or {}).get("commit")
        if made != tip:
            return Verdict(INTEGRITY, "acknowledged commit is not main's tip")
        expected[str(made)] = ctx.bases.digests_of_file(ws / "s4.pt")
    if op in ("checkout-dir", "export"):
        mixed = _mixed_output(ws)
        if mixed:
            return Verdict(INTEGRITY, mixed)
    if (bad := ctx.fsck_clean(ws)) is not None:
        return bad
    bad, _ = ctx.verify(ws, expected)
    if bad is not None:
        return bad
    nxt = ctx.cli(_signal_argv(op, 2), ws)
    if nxt.rc != 0:
        return Verdict(FAILED, f"the next {op} fails: {judge(nxt, 'ok').detail}")
    if left := temp_leftovers(ws / "r", ws):
        return Verdict(INTEGRITY, f"temporary files left after the next {op}: {left[:3]}")
    return Verdict(HANDLED)


def _mixed_output(ws: Path) -> str | None:
    """None when ws/out is exactly reference checkout 1 or 2."""
    out = tree_state(ws / "out") if (ws / "out").exists() else None
    refs = [tree_state(ws / f"ref{k}") for k in (1, 2)]
    if out in refs:
        return None
    if out is None:
        return "output directory gone after the interrupted run"
    return f"mixed-version output directory: vs v1 {tree_diff(refs[0], out)}; vs v2 {tree_diff(refs[1], out)}"


# ---- category: two writers plus gc in loops -------------------------------


def writers_category(ctx: Ctx) -> Iterator[Case]:
    rounds = 3 if not ctx.args.long else 10
    for r in range(rounds):
        yield Case("writers", f"round {r}: 2 writers x {ctx.args.writer_commits} commits + gc loop", _writers_case)


def _writers_case(ctx: Ctx) -> Verdict:
    ws = ctx.fresh("two")
    n = ctx.args.writer_commits
    results: list[tuple[str, Proc]] = []
    acked: dict[str, str] = {}
    stop = threading.Event()

    def writer(w: int) -> None:
        for i in range(n):
            src = f"../s{3 + (w + i) % 4}.pt"
            proc = ctx.cli(["-C", "r", "commit", src, "-m", f"w{w} {i}", "--json"], ws)
            results.append((f"writer {w} commit {i}", proc))
            if proc.rc == 0 and (made := (proc.json() or {}).get("commit")):
                acked[made] = ctx.bases.digests_of_file(ws / src[3:])

    def collector() -> None:
        while not stop.is_set():
            results.append(("gc", ctx.cli(["-C", "r", "gc"], ws)))

    threads = [threading.Thread(target=writer, args=(w,)) for w in (0, 1)]
    gc_thread = threading.Thread(target=collector)
    for t in [*threads, gc_thread]:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    gc_thread.join()
    problems = [f"{name}: {v.detail}" for name, p in results if (v := judge(p, "any")).verdict != HANDLED]
    crashes = [x for x in problems if "hang" in x or "killed" in x]
    if crashes:
        return Verdict(CRASH, "; ".join(crashes[:3]))
    if problems:
        return Verdict(FAILED, f"{len(problems)}/{len(results)} calls: " + "; ".join(problems[:3]))
    refused = [p.rc for _, p in results if p.rc]
    if (bad := ctx.fsck_clean(ws)) is not None:
        return bad
    expected = {**ctx.bases.digests, **acked}
    bad, _ = ctx.verify(ws, expected, branch=None)
    if bad is not None:
        return bad
    reachable = ctx.cli(["-C", "r", "log", "--json"], ws).stdout
    lost = [c[:12] for c in acked if c not in reachable]
    if lost:
        return Verdict(INTEGRITY, f"acknowledged commits not in main's history: {lost}")
    return Verdict(HANDLED, f"{len(acked)} acknowledged, refusals {collections.Counter(refused)}")


# ---- category: deep and huge states ---------------------------------------


def deep_category(ctx: Ctx) -> Iterator[Case]:
    depths = (50, 150, 195, 250, 400, 600, 1000, 5000) if ctx.args.long else (150, 250, 600, 5000)
    specs = [f"deep-{kind}-{d}" for kind in ("tuple", "odict", "dict", "list") for d in depths]
    specs += ["wide-20000" if ctx.args.long else "wide-3000", "longlist-200000", "bigint-2000", "longkey-100000"]
    specs += ["bigstr-50000000" if ctx.args.long else "bigstr-5000000", "emptytensors-0", "scalars-0"]
    for spec in specs:
        yield Case("deep", f"{spec}: commit", functools.partial(_deep_case, spec=spec, step="commit"))
        for step in ("load", "show", "checkout-o", "fsck"):
            yield Case("deep", f"{spec}: {step}", functools.partial(_deep_case, spec=spec, step=step))


@functools.cache
def _deep_repo(ctx: Ctx, spec: str) -> tuple[Path, Proc]:
    """One repository per deep state, shared by that state's steps."""
    ws = ctx.fresh()
    ctx.keep.add(ws)
    return ws, ctx.runner.run("commit_state", str(ws / "r"), spec, spec, cwd=ws)


def _deep_case(ctx: Ctx, *, spec: str, step: str) -> Verdict:
    ws, made = _deep_repo(ctx, spec)
    v = judge(made, "any")
    if step == "commit" or made.rc != 0:
        return v if step == "commit" else Verdict(HANDLED, "commit refused")
    report = made.json()
    if step == "load":
        bad, _ = ctx.verify(ws, {report["commit"]: report["digest"]})
        return bad or Verdict(HANDLED)
    argv = {"show": ["show"], "checkout-o": ["checkout", "HEAD", "-o", "../deep-out.pt"], "fsck": ["fsck"]}[step]
    proc = ctx.cli(["-C", "r", *argv], ws)
    v = judge(proc, "ok", fsck=step == "fsck")
    if v.verdict == HANDLED and step == "fsck" and proc.rc != 0:
        return Verdict(INTEGRITY, "fsck reports damage in an acknowledged commit")
    return v


# ---- category: the bucket side (S3 server behind the fault proxy) ---------

# Each request may take this long in the children (CKVC_REMOTE_TIMEOUT), so that a
# request made to hang (the "hang" fault) times out within a case.
REMOTE_TIMEOUT_S = 2.0
# A dead endpoint fails an operation within a minute (docs/GUIDE.md, Remotes): an
# op still running after this long hangs.
REMOTE_OP_TIMEOUT_S = 90.0
# Fault kinds an object store produces: Rule arguments of tests/fault_proxy.py.
REMOTE_FAULTS: dict[str, dict[str, Any]] = {
    "500": {"fault": "status", "status": 500},
    "503-slowdown": {"fault": "status", "status": 503},
    "reset": {"fault": "reset"},
    "reset-after": {"fault": "reset", "after": True},  # the request landed, its answer is lost
    "truncated": {"fault": "truncate"},
    "hang": {"fault": "slow", "delay": REMOTE_TIMEOUT_S + 1.5},
    "403": {"fault": "status", "status": 403},
    "404-listed": {"fault": "status", "status": 404, "method": "GET"},  # an object that was listed
}
TRANSIENT_FAULTS = {"500", "503-slowdown", "reset", "reset-after", "truncated", "hang"}
REMOTE_OPS = ("push", "fetch", "clone", "lazy-read", "fsck-remote", "gc-remote")
# Damage a shared bucket can suffer between operations, and what fsck --remote must say.
REMOTE_DAMAGE: dict[str, frozenset[str]] = {  # name -> fsck error kinds, one of which it must report
    "deleted-pack": frozenset({"missing-object", "missing-pack"}),
    "truncated-pack": frozenset({"bad-pack", "missing-object", "bad-checksum"}),
    "swapped-toc-copies": frozenset({"bad-toc-copy"}),
    "ref-to-missing-commit": frozenset({"dangling-ref"}),
    "ref-rolled-back": frozenset(),  # no damage: another writer's force push
    "foreign-repository-pack": frozenset(),  # valid objects nothing here names
    "partial-listing": frozenset(),  # a fault, not damage
}
DAMAGE_FOLLOW_UPS = ("fetch", "clone", "lazy-read", "fsck-remote", "gc-remote")


class RemoteRig:
    """The S3 test server (moto, 127.0.0.1) and the fault proxy in front of it,
    started once per run; each case gets a fresh prefix of one bucket."""

    def __init__(self) -> None:
        sys.path.insert(0, str(REPO_ROOT / "tests"))
        from fault_proxy import FaultProxy, Rule
        from s3server import FAKE_CREDENTIALS, S3Server

        self.Rule = Rule
        self.server = S3Server.start()
        self.proxy = FaultProxy(self.server.endpoint).__enter__()
        self.bucket = self.server.create_bucket()
        self.credentials = FAKE_CREDENTIALS
        self.env = {**FAKE_CREDENTIALS, "CKVC_REMOTE_TIMEOUT": str(REMOTE_TIMEOUT_S), "CKVC_THREADS": "1"}
        self.cases = 0

    def url(self) -> str:
        self.cases += 1
        return f"s3://{self.bucket}/case{self.cases}"

    def direct(self, url: str) -> Any:
        """The bucket prefix's backend, straight to the server (no faults)."""
        from ckvc.storage.cloud import open_object_store

        saved = {k: os.environ.get(k) for k in self.credentials}
        os.environ.update(self.credentials)  # read when the client is made; not left in this process
        try:
            return open_object_store(url, endpoint=self.server.endpoint)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def remote_tip(self, url: str, branch: str = "main") -> str | None:
        data = self.direct(url).get(f"refs/heads/{branch}")
        return None if data is None else data.decode().strip()

    def close(self) -> None:
        self.proxy.__exit__(None, None, None)
        self.server.stop()


_rig: RemoteRig | None = None


def remote_rig() -> RemoteRig:
    global _rig
    if _rig is None:
        _rig = RemoteRig()
        atexit.register(_rig.close)
    return _rig


def _remote_available() -> str | None:
    try:
        import moto  # noqa: F401
        import obstore  # noqa: F401
    except ImportError as exc:
        return f"the remote extra and moto[server] are needed: {exc}"
    return None


@dataclasses.dataclass
class RemoteWs:
    """A prepared workspace: r/ pushed to ``url`` (the base history), and what the op needs."""

    ws: Path
    url: str
    expected: dict[str, str]  # commit -> digest, every acknowledged commit
    old_tip: str  # the remote's main before the op
    new_tip: str | None = None  # a commit the op should carry (push, fetch)


def _rcli(ctx: Ctx, argv: list[str], ws: Path, **kw: Any) -> Proc:
    return ctx.cli(argv, ws, env=remote_rig().env, **kw)


def _must_r(ctx: Ctx, argv: list[str], ws: Path) -> Proc:
    proc = _rcli(ctx, argv, ws)
    if proc.rc != 0:
        raise RuntimeError(f"remote setup {argv} failed: {_last_error_line(proc.stderr)}")
    return proc


_remote_templates: dict[str, RemoteWs] = {}


def _remote_prepare(ctx: Ctx, op: str) -> RemoteWs:
    """The state just before ``op``: a copy of a template made once per op (its
    workspace, and its bucket prefix copied object by object to a fresh one)."""
    rig = remote_rig()
    if op not in _remote_templates:
        # A fresh prefix: a second suite in this process (the quick run, then the
        # short one) builds its templates again while the rig's bucket lives on.
        _remote_templates[op] = _remote_build(ctx, op, f"{rig.url()}-template-{op}")
        ctx.keep.add(_remote_templates[op].ws)
    template = _remote_templates[op]
    ws, url = Path(tempfile.mkdtemp(dir=ctx.work)), rig.url()
    shutil.copytree(template.ws, ws, dirs_exist_ok=True, symlinks=True)
    source, target = rig.direct(template.url), rig.direct(url)
    for key in source.list(""):
        target.put(key, source.get(key))
    for settings in ws.glob("*/.ckvc/*.json"):  # the remote's URL, in r and its clones
        text = settings.read_text()
        if template.url in text:
            settings.write_text(text.replace(template.url, url))
    return dataclasses.replace(template, ws=ws, url=url, expected=dict(template.expected))


def _remote_build(ctx: Ctx, op: str, url: str) -> RemoteWs:
    """The state just before ``op``, with no faults: the base history pushed to
    ``url``, plus what the op works on (a new commit to push or fetch, a clone to
    fetch into, a lazy clone to read through, garbage for gc)."""
    rig = remote_rig()
    ws = ctx.fresh("two")
    _must_r(ctx, ["-C", "r", "remote", "add", "origin", url, "--endpoint", rig.proxy.endpoint], ws)
    _must_r(ctx, ["-C", "r", "push", "origin"], ws)
    expected = dict(ctx.bases.digests)
    prep = RemoteWs(ws, url, expected, str(_read_tip(ws)))
    if op in ("push", "fetch", "gc-remote"):
        if op == "fetch":
            _must_r(ctx, ["clone", url, "c", "--endpoint", rig.proxy.endpoint], ws)
        made = _must_r(ctx, ["-C", "r", "commit", "../s3.pt", "-m", "new", "--json"], ws).json()["commit"]
        prep.new_tip = made
        expected[made] = ctx.bases.digests_of_file(ws / "s3.pt")
        if op in ("fetch", "gc-remote"):
            _must_r(ctx, ["-C", "r", "push", "origin"], ws)
        if op == "gc-remote":  # the new commit becomes the bucket's garbage
            _must_r(ctx, ["-C", "r", "reset", "--hard", prep.old_tip], ws)
            _must_r(ctx, ["-C", "r", "push", "-f", "origin"], ws)
            del expected[made]
            prep.new_tip = None
        if op == "fetch":
            prep.old_tip = made  # on the remote before the fetch; c has the base only
    elif op == "lazy-read":
        _must_r(ctx, ["clone", "--lazy", url, "c3", "--endpoint", rig.proxy.endpoint], ws)
    return prep


def _remote_op(ctx: Ctx, op: str, prep: RemoteWs, **kw: Any) -> Proc:
    """Run ``op`` (faults as the proxy's rules are now)."""
    _, finish = _remote_op_start(ctx, op, prep)
    return finish(REMOTE_OP_TIMEOUT_S)


def _remote_op_start(ctx: Ctx, op: str, prep: RemoteWs) -> tuple[int, Callable[[float | None], Proc]]:
    rig = remote_rig()
    if op == "lazy-read":
        return ctx.runner.start(
            "verify", str(prep.ws / "c3"), dict(ctx.bases.digests), "main", cwd=prep.ws, env=rig.env
        )
    argv = _remote_op_argv(op, prep)
    return ctx.runner.start("cli", argv, cwd=prep.ws, env=rig.env)


def _remote_op_argv(op: str, prep: RemoteWs) -> list[str]:
    rig = remote_rig()
    return {
        "push": ["-C", "r", "push", "origin"],
        "fetch": ["-C", "c", "fetch", "origin"],
        "clone": ["clone", prep.url, "c2", "--endpoint", rig.proxy.endpoint],
        "fsck-remote": ["-C", "r", "fsck", "--remote", "origin"],
        "gc-remote": ["-C", "r", "gc", "--remote", "origin", "--now"],
    }[op]


_CKVC_ERRORS: frozenset[str] = frozenset()


def _ckvc_error_names() -> frozenset[str]:
    global _CKVC_ERRORS
    if not _CKVC_ERRORS:
        import ckvc.errors

        _CKVC_ERRORS = frozenset(
            n for n, v in vars(ckvc.errors).items() if isinstance(v, type) and issubclass(v, ckvc.errors.CkvcError)
        ) | {"BackendError"}
    return _CKVC_ERRORS


def _judge_reads(proc: Proc) -> Verdict:
    """A verify child's report: a wrong byte is an integrity failure, an untyped error a failure."""
    v = judge(proc, "ok")
    if v.verdict != HANDLED:
        return v
    report = proc.json() or {}
    for commit, outcome in report.get("commits", {}).items():
        if outcome == "mismatch":
            return Verdict(INTEGRITY, f"commit {commit[:12]} read back with wrong bytes")
        if outcome.startswith("error: ") and outcome[7:].split(":")[0] not in _ckvc_error_names():
            return Verdict(FAILED, f"commit {commit[:12]}: untyped {outcome[:160]}")
    return Verdict(HANDLED)


def _judge_remote_refusal(proc: Proc, prep: RemoteWs) -> Verdict | None:
    """A refused remote operation must say which remote (its URL or name)."""
    if proc.rc not in (None, 0, 1) and prep.url not in proc.stderr and "origin" not in proc.stderr:
        return Verdict(FAILED, f"exit {proc.rc} without naming the remote: {_last_error_line(proc.stderr)}")
    return None


def _cut_off_lease(proc: Proc) -> bool:
    from ckvc.errors import RepositoryLockedError

    return proc.rc == RepositoryLockedError.exit_code and "lease runs out in" in proc.stderr


def _remote_settle(ctx: Ctx, op: str, prep: RemoteWs, proc: Proc, kind: str | None) -> Verdict:
    """After the op (faulted or killed): what it acknowledged holds, the bucket is
    consistent, and the same op, run again without faults, succeeds."""
    rig = remote_rig()
    ws = prep.ws
    if proc.rc is not None:  # None: killed on purpose, nothing of its own to judge
        v = _judge_reads(proc) if op == "lazy-read" else judge(proc, "any", fsck=op == "fsck-remote")
        if v.verdict in (CRASH, FAILED, INTEGRITY):
            return v
        if (bad := _judge_remote_refusal(proc, prep)) is not None:
            return bad
    tip = rig.remote_tip(prep.url)
    allowed = {prep.old_tip, prep.new_tip} if op == "push" else {prep.old_tip}
    if tip not in allowed:
        return Verdict(INTEGRITY, f"the bucket's main is {str(tip)[:12]}, not one of {[str(a)[:12] for a in allowed]}")
    if op == "push" and proc.rc == 0 and tip != prep.new_tip:
        return Verdict(INTEGRITY, "push acknowledged but the bucket's main did not move")
    if op == "fetch":
        fetched = (ws / "c" / ".ckvc" / "refs" / "remotes" / "origin" / "main").read_text().strip()
        if proc.rc == 0 and fetched != prep.new_tip:
            return Verdict(INTEGRITY, "fetch acknowledged but origin/main did not move")
        if fetched not in (ctx.bases.ids[-1], prep.new_tip):
            return Verdict(INTEGRITY, f"origin/main is {fetched[:12]} after the fetch")
    if op == "fsck-remote" and proc.rc == 1 and not str(kind).startswith("404-listed"):
        return Verdict(FAILED, f"fsck --remote reported damage that is not there ({kind}): {proc.stdout[-200:]!r}")
    if op == "clone" and proc.rc not in (0, None) and (ws / "c2").exists():
        return Verdict(FAILED, "a failed clone left its directory behind")
    # The bucket, read with no faults: fsck clean, the op again, a fresh clone bit-exact.
    check = _rcli(ctx, ["-C", "r", "fsck", "--remote", "origin"], ws) if op in ("push", "gc-remote") else None
    if check is not None and check.rc != 0:
        return Verdict(
            INTEGRITY, f"fsck --remote not clean after the fault: {_last_error_line(check.stdout + check.stderr)}"
        )
    if op == "clone":
        shutil.rmtree(ws / "c2", ignore_errors=True)
    again = _remote_op(ctx, op, prep)
    if _cut_off_lease(again) and (kind is None or kind.endswith("persistent") or kind.startswith(("403", "404"))):
        # A writer cut off from the store (a kill, an outage to the end, a refused
        # delete, never retried) cannot delete its lease: the next one is refused, told
        # when it runs out (tests/storage). A transient fault once is retried: no excuse.
        again = dataclasses.replace(again, rc=0)
    if op == "lazy-read":
        if (bad := _judge_reads(again)).verdict != HANDLED:
            return bad
        if any(o != "ok" for o in (again.json() or {}).get("commits", {}).values()):
            return Verdict(FAILED, "the lazy read fails again without faults")
    elif again.rc != 0:
        return Verdict(FAILED, f"the {op} fails again without faults: {_last_error_line(again.stderr)}")
    if op in ("fetch", "clone", "lazy-read", "fsck-remote"):
        return Verdict(HANDLED, f"exit {proc.rc}")  # reads: the bucket is as it was (fsck --remote said so)
    verify_dir = ws / "fresh"
    _must_r(ctx, ["clone", prep.url, "fresh", "--endpoint", rig.server.endpoint], ws)
    on_remote = {c: d for c, d in prep.expected.items() if c != prep.new_tip or rig.remote_tip(prep.url) == c}
    report = ctx.runner.run("verify", str(verify_dir), on_remote, "main", cwd=ws).json() or {}
    bad_commits = {c[:12]: o for c, o in report.get("commits", {}).items() if o != "ok"}
    if bad_commits:
        return Verdict(INTEGRITY, f"acknowledged commits not on the bucket bit-exact: {bad_commits}")
    return Verdict(HANDLED, f"exit {proc.rc}")


# Injection points per (op, fault, mode) in the long run, spread over the op's
# requests from the first to the last (every request of every op would take hours).
REMOTE_POINTS_LONG = 10


def spread_points(n: int, most: int) -> list[int]:
    if n <= most:
        return list(range(n))
    return sorted({round(i * (n - 1) / (most - 1)) for i in range(most)})


_remote_counts: dict[str, list[tuple[str, str]]] = {}


def _remote_requests(ctx: Ctx, op: str) -> list[tuple[str, str]]:
    """(method, path) of each request ``op`` makes, from one run without faults."""
    if op not in _remote_counts:
        rig = remote_rig()
        prep = _remote_prepare(ctx, op)
        rig.proxy.reset_counts()
        proc = _remote_op(ctx, op, prep)
        if proc.rc != 0:
            raise RuntimeError(f"{op} without faults failed: {_last_error_line(proc.stderr)}")
        _remote_counts[op] = list(rig.proxy.requests)
    return _remote_counts[op]


def remote_category(ctx: Ctx) -> Iterator[Case]:
    _remote_templates.clear()
    if (missing := _remote_available()) is not None:
        yield Case("remote", f"skipped: {missing}", lambda ctx: Verdict("skip", missing))
        return
    rng = random.Random(ctx.args.seed + 5)
    # The quick run (the default test tier) counts the requests of two ops, not six.
    ops = ("push", "lazy-read") if ctx.args.quick else REMOTE_OPS
    for op in ops:
        requests = _remote_requests(ctx, op)
        gets = [i for i, (m, _) in enumerate(requests) if m == "GET"]
        for kind, spec in REMOTE_FAULTS.items():
            modes = ("once", "persistent") if kind in TRANSIENT_FAULTS else ("once",)
            for mode in modes:
                n = len(gets) if spec.get("method") == "GET" else len(requests)
                points = (
                    spread_points(n, REMOTE_POINTS_LONG) if ctx.args.long else sorted(rng.sample(range(n), min(n, 2)))
                )
                for k in points:
                    at = requests[gets[k]] if spec.get("method") == "GET" else requests[k]
                    key = at[1].split("?")[0].split("/", 3)[3:]  # /bucket/caseN/key: the key
                    what = f"{at[0]} {re.sub(r'[0-9a-f]{16,}', '*', key[0] if key else '(listing)')[-60:]}"
                    yield Case(
                        "remote",
                        f"{op}: {kind} {mode} at request {k + 1} ({what})",
                        P(_remote_fault_case, op=op, kind=kind, mode=mode, k=k),
                    )
    kills = max(1, ctx.args.kills * 2 // 3)
    for i in range(kills):
        op = ops[i % len(ops)]
        frac = rng.random() * 1.1
        yield Case("remote", f"{op}: SIGKILL at {frac:.3f} of its run", P(_remote_kill_case, op=op, frac=frac))
    for damage in REMOTE_DAMAGE:
        for follow in DAMAGE_FOLLOW_UPS:
            yield Case("remote", f"damage {damage}: then {follow}", P(_remote_damage_case, damage=damage, op=follow))
    for r in range(10 if ctx.args.long else 1):
        for race in ("two-pushers", "push-and-gc"):
            yield Case("remote", f"race {race}: round {r}", P(_remote_race_case, race=race))


def _remote_fault_case(ctx: Ctx, *, op: str, kind: str, mode: str, k: int) -> Verdict:
    rig = remote_rig()
    prep = _remote_prepare(ctx, op)
    local_before = tree_state(prep.ws / "r" / ".ckvc" / "refs" / "heads")
    spec = dict(REMOTE_FAULTS[kind])
    rig.proxy.rules = [rig.Rule(**spec, skip=k, count=1 if mode == "once" else None)]
    try:
        proc = _remote_op(ctx, op, prep)
        fired = rig.proxy.fired()
    finally:
        rig.proxy.rules = []
    if fired == 0:
        return Verdict(HANDLED, "the fault point was not reached (the op took another path)")
    if tree_state(prep.ws / "r" / ".ckvc" / "refs" / "heads") != local_before:
        return Verdict(FAILED, f"{op} changed the local branches")
    return _remote_settle(ctx, op, prep, proc, f"{kind} {mode}")


_remote_durations: dict[str, float] = {}


def _remote_kill_case(ctx: Ctx, *, op: str, frac: float) -> Verdict:
    if op not in _remote_durations:
        _remote_durations[op] = _remote_op(ctx, op, _remote_prepare(ctx, op)).seconds
    prep = _remote_prepare(ctx, op)
    pid, finish = _remote_op_start(ctx, op, prep)
    time.sleep(_remote_durations[op] * frac)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    done = finish(REMOTE_OP_TIMEOUT_S)
    if done.timed_out:
        return Verdict(CRASH, "hang after SIGKILL")
    if done.signal is not None:  # killed as meant: judge what it left, as a refusal
        done = dataclasses.replace(done, signal=None, rc=None)
        if op == "clone":
            shutil.rmtree(prep.ws / "c2", ignore_errors=True)  # a killed clone cannot clean up; the next one must cope
    return _remote_settle(ctx, op, prep, done, None)


def _damage(rig: RemoteRig, url: str, damage: str, ctx: Ctx, ws: Path) -> str | None:
    """Do ``damage`` to the bucket prefix; returns the object or pack it hit."""
    from ckvc.storage.packs import PACK_DIR, pack_key, toc_copy_name

    backend = rig.direct(url)
    packs = sorted(k for k in backend.list(f"{PACK_DIR}/") if k.endswith(".pack"))
    if damage == "deleted-pack":
        backend.delete(packs[0])
        return packs[0]
    if damage == "truncated-pack":
        data = backend.get(packs[0])
        backend.put(packs[0], data[: len(data) // 2])
        return packs[0]
    if damage == "swapped-toc-copies":
        a, b = (pack_key(toc_copy_name(p.rsplit("/", 1)[1])) for p in packs[:2])
        da, db = backend.get(a), backend.get(b)
        backend.put(a, db)
        backend.put(b, da)
        return a
    if damage == "ref-to-missing-commit":
        backend.put("refs/heads/main", ("ab" * 32 + "\n").encode())
        return "ab" * 32
    if damage == "ref-rolled-back":  # another writer forced main back to its first commit
        backend.put("refs/heads/main", (ctx.bases.ids[0] + "\n").encode())
        return None
    if damage == "foreign-repository-pack":  # another repository's pack under the same prefix
        other = rig.url()
        _must_r(ctx, ["init", "other"], ws)
        _must_r(ctx, ["-C", "other", "commit", "../s5.pt", "-m", "other"], ws)
        _must_r(ctx, ["-C", "other", "remote", "add", "origin", other, "--endpoint", rig.server.endpoint], ws)
        _must_r(ctx, ["-C", "other", "push", "origin"], ws)
        source = rig.direct(other)
        for key in source.list(f"{PACK_DIR}/"):
            backend.put(key, source.get(key))
        return None
    if damage == "partial-listing":  # the next listing is cut short once
        rig.proxy.rules = [rig.Rule("truncate", method="GET", path="list-type", count=1)]
        return None
    raise AssertionError(damage)


def _remote_damage_case(ctx: Ctx, *, damage: str, op: str) -> Verdict:
    rig = remote_rig()
    prep = _remote_prepare(ctx, "fetch")  # two pushes: two packs on the bucket
    if op == "lazy-read":
        _must_r(ctx, ["clone", "--lazy", prep.url, "c3", "--endpoint", rig.proxy.endpoint], prep.ws)
    hit = _damage(rig, prep.url, damage, ctx, prep.ws)
    try:
        if op == "fsck-remote":
            proc = _rcli(ctx, ["-C", "r", "fsck", "--remote", "origin", "--json"], prep.ws)
        else:
            proc = _remote_op(ctx, op, prep)
    finally:
        rig.proxy.rules = []
    if op == "lazy-read":
        return _judge_reads(proc)
    v = judge(proc, "any", fsck=op == "fsck-remote")
    if v.verdict != HANDLED:
        return v
    if (bad := _judge_remote_refusal(proc, prep)) is not None:
        return bad
    if op == "fsck-remote":
        kinds = {p["kind"] for p in (proc.json() or {}).get("problems", []) if p.get("severity") == "error"}
        want = REMOTE_DAMAGE[damage]
        if not want and kinds:
            return Verdict(FAILED, f"fsck --remote reports damage that was not done: {sorted(kinds)}")
        if want and not want & kinds:
            return Verdict(FAILED, f"fsck --remote misses {sorted(want)} (reported {sorted(kinds)}; hit {hit})")
    if op == "clone" and proc.rc == 0:
        report = ctx.runner.run("verify", str(prep.ws / "c2"), dict(ctx.bases.digests), None, cwd=prep.ws).json() or {}
        wrong = [c[:12] for c, o in report.get("commits", {}).items() if o == "mismatch"]
        if wrong:
            return Verdict(INTEGRITY, f"a clone of the damaged bucket returned wrong bytes for {wrong}")
    if op == "gc-remote" and damage in ("ref-rolled-back", "foreign-repository-pack", "partial-listing"):
        check = _rcli(ctx, ["-C", "r", "fsck", "--remote", "origin"], prep.ws)
        if check.rc != 0:
            return Verdict(INTEGRITY, f"gc --remote damaged the bucket: {_last_error_line(check.stdout)}")
    return Verdict(HANDLED, f"exit {proc.rc}")


def _remote_race_case(ctx: Ctx, *, race: str) -> Verdict:
    rig = remote_rig()
    prep = _remote_prepare(ctx, "fetch")  # r and c: two writers on the same bucket
    ws = prep.ws
    _must_r(ctx, ["-C", "r", "commit", "../s4.pt", "-m", "writer r", "--json"], ws)
    mine = str(_read_tip(ws))
    prep.expected[mine] = ctx.bases.digests_of_file(ws / "s4.pt")
    _must_r(ctx, ["-C", "c", "fetch", "origin"], ws)
    _must_r(ctx, ["-C", "c", "reset", "--hard", "origin/main"], ws)
    theirs = _must_r(ctx, ["-C", "c", "commit", "../s6.pt", "-m", "writer c", "--json"], ws).json()["commit"]
    prep.expected[theirs] = ctx.bases.digests_of_file(ws / "s6.pt")
    second = (
        ["-C", "c", "push", "origin"] if race == "two-pushers" else ["-C", "c", "gc", "--remote", "origin", "--now"]
    )
    results: dict[str, Proc] = {}
    threads = [
        threading.Thread(target=lambda: results.__setitem__("r", _rcli(ctx, ["-C", "r", "push", "origin"], ws))),
        threading.Thread(target=lambda: results.__setitem__("c", _rcli(ctx, second, ws))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name, proc in results.items():
        if (v := judge(proc, "any")).verdict != HANDLED:
            return Verdict(v.verdict, f"writer {name}: {v.detail}")
    tip = rig.remote_tip(prep.url)
    pushers = (("r", mine), ("c", theirs)) if race == "two-pushers" else (("r", mine),)
    acked = [commit for name, commit in pushers if results[name].rc == 0]
    if len(acked) == 2:
        return Verdict(INTEGRITY, "two diverging pushes both acknowledged")
    if acked and tip != acked[0]:
        return Verdict(INTEGRITY, f"push of {acked[0][:12]} acknowledged but the bucket's main is {str(tip)[:12]}")
    check = _rcli(ctx, ["-C", "r", "fsck", "--remote", "origin"], ws)
    if check.rc != 0:
        return Verdict(
            INTEGRITY, f"fsck --remote not clean after the race: {_last_error_line(check.stdout + check.stderr)}"
        )
    _must_r(ctx, ["clone", prep.url, "fresh", "--endpoint", rig.server.endpoint], ws)
    on_remote = {c: d for c, d in prep.expected.items() if c not in (mine, theirs) or c == tip}
    report = ctx.runner.run("verify", str(ws / "fresh"), on_remote, "main", cwd=ws).json() or {}
    bad = {c[:12]: o for c, o in report.get("commits", {}).items() if o != "ok"}
    if bad:
        return Verdict(INTEGRITY, f"commits on the bucket not bit-exact after the race: {bad}")
    return Verdict(HANDLED, f"exits {results['r'].rc}/{results['c'].rc}")


# ---------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------

CATEGORY_GENERATORS: dict[str, Callable[[Ctx], Iterable[Case]]] = {
    "cli": cli_category,
    "crafted": crafted_category,
    "faults": fault_category,
    "diskfull": diskfull_category,
    "readonly": readonly_category,
    "signals": signal_category,
    "writers": writers_category,
    "deep": deep_category,
    "remote": remote_category,
}


def run_suite(
    args: argparse.Namespace, log: Callable[[str], None] = print
) -> tuple[dict[str, dict[str, int]], list[Result]]:
    """Run the selected categories; returns (figures per category, every result)."""
    import torch

    torch.set_num_threads(1)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="ckvc-torture-", dir=args.workdir) as tmp:
        root = Path(tmp)
        (root / "scratch").mkdir()
        (root / "work").mkdir()
        runner = Runner(root / "scratch", timeout=args.timeout)
        ctx = Ctx(runner, root / "work", Bases(runner, root / "bases"), args)
        ctx.bases.path("two")
        for category in args.categories:
            started = time.monotonic()
            cases = list(CATEGORY_GENERATORS[category](ctx))
            if args.match:
                cases = [c for c in cases if re.search(args.match, f"{category}/{c.name}")]
            elif not args.long and not args.case:
                quota = SHORT_QUOTA[category]
                quota = QUICK_QUOTA.get(category, max(1, quota // QUICK_FRACTION)) if args.quick else quota
                cases = spread_sample(cases, quota, random.Random(args.seed))
            for case in cases:
                if args.case and case.name != args.case.split("/", 1)[-1]:
                    continue
                try:
                    v = case.run(ctx)
                except Exception as exc:  # a harness error must not pass as handled
                    line = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if f.filename == __file__][-1]
                    v = Verdict(FAILED, f"harness error: {type(exc).__name__}: {exc} (torture.py:{line})")
                results.append(Result(category, case.name, v.verdict, v.detail))
                if args.verbose or v.verdict not in (HANDLED, "skip"):
                    log(f"  [{v.verdict:9}] {category}/{case.name}: {v.detail}")
                for child in ctx.work.iterdir():
                    if child not in ctx.keep:
                        shutil.rmtree(child, ignore_errors=True)
            count = sum(r.category == category for r in results)
            log(f"{category}: {count} cases in {time.monotonic() - started:.0f} s")
            _deep_repo.cache_clear()
            ctx.keep.clear()
        runner.close()
    return figures(results), results


# Cases per category in the short run: a sample spread over the case families.
SHORT_QUOTA = {
    "cli": 70,
    "crafted": 80,
    "faults": 24,
    "diskfull": 8,
    "readonly": 18,
    "signals": 24,
    "writers": 1,
    "deep": 30,
    "remote": 40,
}

# The quick run (the default test tier) tries this fraction of each quota, and
# fewer of the cases that each take seconds (a timed run, then the kill or the fault).
QUICK_FRACTION = 5
QUICK_QUOTA = {"faults": 2, "signals": 2, "remote": 6}


def spread_sample(cases: list[Case], quota: int, rng: random.Random) -> list[Case]:
    """Up to ``quota`` cases, taken round-robin over families (what precedes ':' in
    a name, else its first word, without trailing numbers) in a seeded order, so
    every kind of case is tried before any is tried twice."""
    families: dict[str, list[Case]] = collections.defaultdict(list)
    for case in cases:
        head = case.name.split(":")[0] if ":" in case.name else case.name.split(" ")[0]
        families[re.sub(r"[@-]?[\d.]+$", "", head)].append(case)
    for members in families.values():
        rng.shuffle(members)
    picked: list[Case] = []
    while len(picked) < quota and any(families.values()):
        for members in families.values():
            if members and len(picked) < quota:
                picked.append(members.pop())
    order = {id(c): i for i, c in enumerate(cases)}
    return sorted(picked, key=lambda c: order[id(c)])


def figures(results: list[Result]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in results:
        row = out.setdefault(r.category, {"tried": 0, "skipped": 0, **{v: 0 for v in VERDICTS}})
        if r.verdict == "skip":
            row["skipped"] += 1
            continue
        row["tried"] += 1
        row[r.verdict] += 1
    return out


COLUMNS = (
    ("tried", "tried"),
    ("handled", HANDLED),
    ("failed", FAILED),
    ("integrity", INTEGRITY),
    ("crashes", CRASH),
    ("skipped", "skipped"),
)


def table(figs: dict[str, dict[str, int]]) -> str:
    def row(name: str, values: dict[str, int]) -> str:
        return f"{name:10}" + "".join(f" {values.get(key, 0):>{len(title) + 1}}" for title, key in COLUMNS)

    head = f"{'category':10}" + "".join(f" {title:>{len(title) + 1}}" for title, _ in COLUMNS)
    total: collections.Counter[str] = collections.Counter()
    lines = [head, "-" * len(head)]
    for cat, values in figs.items():
        total.update(values)
        lines.append(row(cat, values))
    return "\n".join([*lines, "-" * len(head), row("total", total)])


def grouped_failures(results: list[Result]) -> dict[str, list[Result]]:
    """Failures grouped by cause: the verdict and the detail with numbers and ids stripped."""
    groups: dict[str, list[Result]] = collections.defaultdict(list)
    for r in results:
        if r.verdict in (HANDLED, "skip"):
            continue
        cause = re.sub(r"'?/\S+", "PATH", r.detail)
        cause = re.sub(r"\b[0-9a-f]{12,64}\b|\d+", "N", cause)[:140]
        groups[f"{r.verdict}: {cause}"].append(r)
    return dict(sorted(groups.items(), key=lambda kv: -len(kv[1])))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long", action="store_true", help="The long run (every injection point, 300+ kills).")
    p.add_argument(
        "--quick",
        action="store_true",
        help="A fifth of the short run's sample (the default test tier; the short run is in the stress tier).",
    )
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--category", dest="categories", action="append", choices=CATEGORIES)
    p.add_argument("--case", default=None, help="Run only the case of this name (category/name).")
    p.add_argument("--match", default=None, metavar="REGEX", help="Run every case whose category/name matches.")
    p.add_argument(
        "--kills", type=int, default=None, help="SIGKILLs in total (default 18, long 300); SIGINTs: a third."
    )
    p.add_argument("--writer-commits", type=int, default=None)
    p.add_argument("--timeout", type=float, default=CASE_TIMEOUT_S, help="Per child process, seconds.")
    p.add_argument("--workdir", default=None, help="Where the scratch directory goes (default: $TMPDIR).")
    p.add_argument("--json", action="store_true", help="Print the figures and failures as JSON.")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.case and not args.categories:
        args.categories = [args.case.split("/", 1)[0]]
    args.categories = args.categories or list(CATEGORIES)
    args.kills = args.kills or (300 if args.long else 6 if args.quick else 18)
    args.writer_commits = args.writer_commits or (8 if args.long else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode = "long" if args.long else "short"
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    log(f"ckvc torture suite, {mode} run, seed {args.seed}")
    figs, results = run_suite(args, log)
    groups = grouped_failures(results)
    repro = f"python benchmarks/torture.py{' --long' if args.long else ''} --seed {args.seed} -v --case"
    if args.json:
        print(
            json.dumps(
                {
                    "mode": mode,
                    "seed": args.seed,
                    "figures": figs,
                    "failures": [dataclasses.asdict(r) for r in results if r.verdict not in (HANDLED, "skip")],
                    "repro": f"{repro} 'CATEGORY/CASE'",
                },
                indent=1,
            )
        )
    else:
        print()
        print(table(figs))
        if groups:
            print(f"\nfailing cases by cause (reproduce one: {repro} 'CATEGORY/CASE'):")
            for cause, rs in groups.items():
                print(f"- [{len(rs)}] {cause}")
                for r in rs[:6]:
                    print(f"    {r.category}/{r.case}")
                if len(rs) > 6:
                    print(f"    ... and {len(rs) - 6} more")
    return 0


if __name__ == "__main__":
    sys.exit(main())
