"""What `ckvc serve` answers under /api/...: the CLI's --json results (ckvc.inspect's
log_json / to_json, the retention plan's to_json) plus the few views a page needs
on top (refs with labels, metric series per branch, per-tensor storage).

History, metrics and storage read only metadata (commits, snapshots, chunk stats);
only the commit page's tensor table and a diff parse states or read tensors, and
those import torch lazily. One lock serialises the repository: reads are short, and
the Repo is not promised to be safe across threads."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from ckvc import graph, inspect
from ckvc.codecs import CODEC_NAMES
from ckvc.errors import (
    CorruptObjectError,
    DamagedIndexError,
    InvalidInputError,
    InvalidRevisionError,
    ObjectNotFoundError,
    StorageError,
)
from ckvc.objects import Commit
from ckvc.repo import Repo

T = TypeVar("T")

MAX_REV_LEN = 512
DIFF_CACHE_SIZE = 32
# Metric or metadata keys a chart can put on its x axis (first one found wins).
STEP_KEYS = ("step", "global_step", "hf.global_step", "lightning.global_step")
EPOCH_KEYS = ("epoch", "hf.epoch", "lightning.epoch")
# A commit may be read while a writer or gc moves packs under us: such an error is
# retried once on a freshly opened repository before it is reported.
RETRYABLE = (ObjectNotFoundError, CorruptObjectError, StorageError, DamagedIndexError)


def check_rev(rev: str | None, what: str = "revision") -> str:
    """A revision as a query or path parameter: present, short, printable. The
    repository's own resolve() does the rest (ref-name rules, unknown names)."""
    if rev is None or rev == "":
        raise InvalidRevisionError(f"missing {what}")
    if len(rev) > MAX_REV_LEN or not rev.isprintable():
        raise InvalidRevisionError(f"invalid {what} {rev[:64]!r}")
    return rev


def flag(value: str | None) -> bool:
    if value is None:
        return False
    if value.lower() in ("1", "true", "yes", "on", ""):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise InvalidInputError(f"not a flag value: {value[:32]!r}")


def count(value: str | None, what: str) -> int | None:
    if value is None or value == "":
        return None
    if not re.fullmatch(r"[0-9]{1,9}", value):
        raise InvalidInputError(f"{what} must be a non-negative integer, not {value[:32]!r}")
    return int(value)


def _prefixes(path: str) -> list[str]:
    """ "a.b.c" -> ["a.b", "a"]: the containers a leaf's path lies in, nearest first."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


def _first_number(c: Commit, keys: tuple[str, ...]) -> float | None:
    for key in keys:
        for source in (c.metrics, c.metadata):
            v = source.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
    return None


class WebApi:
    """The JSON behind every page, over one repository opened by ``opener``."""

    def __init__(self, opener: Callable[[], Repo]) -> None:
        self._opener = opener
        self._repo = opener()
        self._lock = threading.RLock()
        self._diffs: OrderedDict[tuple[str, str, bool], dict[str, Any]] = OrderedDict()

    def close(self) -> None:
        with self._lock:
            self._repo.close()

    def _run(self, fn: Callable[[Repo], T]) -> T:
        with self._lock:
            try:
                return fn(self._repo)
            except RETRYABLE:
                self._reopen()
                return fn(self._repo)

    def _reopen(self) -> None:
        old, self._repo = self._repo, self._opener()
        old.close()

    # ---- refs and history -------------------------------------------------------

    @staticmethod
    def _refs(repo: Repo) -> dict[str, Any]:
        current, head_id = repo.head()
        branches, tags, remotes = repo.branches(), repo.tags(), repo.remote_branches()
        labels: dict[str, list[str]] = {}  # as `ckvc log` decorates commits
        if head_id:
            labels.setdefault(head_id, []).append(f"HEAD -> {current}" if current else "HEAD")
        for name, oid in branches.items():
            if name != current:
                labels.setdefault(oid, []).append(name)
        for name, oid in tags.items():
            labels.setdefault(oid, []).append(f"tag: {name}")
        for name, oid in remotes.items():
            labels.setdefault(oid, []).append(name)
        return {
            "head": head_id,
            "current": current,
            "branches": branches,
            "tags": tags,
            "remotes": remotes,
            "labels": labels,
        }

    def refs(self) -> dict[str, Any]:
        return self._run(self._refs)

    def info(self) -> dict[str, Any]:
        """The repository's location and refs, for the page header."""
        return self._run(lambda repo: {"path": str(repo.path), **self._refs(repo)})

    def version(self) -> dict[str, Any]:
        """A token that changes when a ref moves or a commit is pruned: pages poll it."""

        def token(repo: Repo) -> dict[str, Any]:
            refs = self._refs(repo)
            refs.pop("labels")
            refs["pruned"] = len(repo.pruned())
            text = json.dumps(refs, sort_keys=True)
            return {"version": hashlib.blake2b(text.encode(), digest_size=12).hexdigest()}

        return self._run(token)

    @staticmethod
    def _log(repo: Repo, rev: str | None, limit: int | None, all_refs: bool) -> list[Commit]:
        if all_refs:  # every branch, tag and HEAD (as `log --all`), and the remote-tracking branches
            start: str | list[str] = [*repo.remote_branches().values(), "HEAD"]
        else:
            start = check_rev(rev) if rev is not None else "HEAD"
        _, head_id = repo.head()
        if head_id is None and not all_refs and start == "HEAD":
            return []
        return repo.log(start, limit=limit, all=all_refs)

    def log(self, rev: str | None = None, limit: int | None = None, all_refs: bool = False) -> list[dict[str, Any]]:
        """``ckvc log --json [--all] [-n N] [REV]`` (inspect.history_json)."""

        def build(repo: Repo) -> list[dict[str, Any]]:
            commits = self._log(repo, rev, limit, all_refs)
            return inspect.history_json(repo.core, commits)

        return self._run(build)

    def metrics(self) -> dict[str, Any]:
        """Each branch's first-parent line, root first, with every commit's metrics and
        its step, epoch and time: one chart line per branch (remote-tracking ones too)."""

        def build(repo: Repo) -> dict[str, Any]:
            commits = {c.id: c for c in self._log(repo, None, None, True)}
            refs = self._refs(repo)
            pruned = repo.pruned()
            lines: dict[str, str] = dict(refs["branches"])
            lines.update(refs["remotes"])
            if not lines and refs["head"]:
                lines["HEAD"] = refs["head"]
            names: set[str] = set()
            series = []
            for name, tip in lines.items():
                chain: list[Commit] = []
                oid: str | None = tip
                while oid is not None and oid in commits:
                    chain.append(commits[oid])
                    oid = commits[oid].parents[0] if commits[oid].parents else None
                chain.reverse()
                points = []
                for index, c in enumerate(chain):
                    values = {
                        k: v for k, v in c.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                    }
                    names.update(values)
                    points.append(
                        {
                            "commit": c.id,
                            "index": index,
                            "step": _first_number(c, STEP_KEYS),
                            "epoch": _first_number(c, EPOCH_KEYS),
                            "time_ns": c.time_ns,
                            "message": c.message.splitlines()[0] if c.message else "",
                            "pruned": c.id in pruned,
                            "metrics": inspect.jsonable(values),
                        }
                    )
                series.append({"branch": name, "tip": tip, "points": points})
            axes = set(STEP_KEYS) | set(EPOCH_KEYS)  # x axes, not curves
            return {"metrics": sorted(names - axes), "series": series}

        return self._run(build)

    # ---- one commit ---------------------------------------------------------------

    def commit(self, rev: str, data: bool = True) -> dict[str, Any]:
        """``ckvc show --json [--no-data] REV``."""
        rev = check_rev(rev)

        def build(repo: Repo) -> dict[str, Any]:
            info = repo.show(rev, tensors=data)
            tag = None
            if graph.branch_named(repo.core, rev) is None and rev in repo.tags():
                tag = repo.tag_object(rev)
            extras = inspect.show_extras_json(repo.core, info.commit.id, tag.id if tag is not None else None)
            return {**info.to_json(tag, tensors=data), **extras}

        return self._run(build)

    def tensors(self, rev: str) -> dict[str, Any]:
        """Per tensor: stored bytes of its buffer's distinct chunks, the codecs they use,
        the lossy report and, for optimizer state, the parameter it belongs to
        (``param``: its path, and the state entry's own), for the commit page's table (reads no tensor data)."""
        rev = check_rev(rev)

        def build(repo: Repo) -> dict[str, Any]:
            from ckvc import state as state_mod
            from ckvc.state import TensorInfo

            commit = repo.read_commit(repo.resolve(rev))
            graph.check_not_pruned(repo.core, commit.id)
            snapshot = repo.read_snapshot(commit)
            skeleton = state_mod.parse_snapshot(snapshot, commit.id, allow_pickle=None).build()
            leaves = state_mod.flatten(skeleton)
            params = inspect.parameter_names(skeleton, snapshot)
            per_blob: dict[int, tuple[int, list[str]]] = {}
            out = []
            for path, leaf in leaves.items():
                if not isinstance(leaf, TensorInfo):
                    continue
                if leaf.blob not in per_blob:
                    stored, names = 0, set()
                    for oid in dict.fromkeys(snapshot.blobs[leaf.blob].chunks):
                        st = repo.store.stat(oid)
                        stored += st.stored_size
                        names.add(CODEC_NAMES.get(st.codec, str(st.codec)))
                    per_blob[leaf.blob] = (stored, sorted(names))
                stored, codecs = per_blob[leaf.blob]
                summary = inspect.tensor_summary(path, leaf, snapshot)
                report = commit.lossy.get(path)
                out.append(
                    {
                        **summary.to_json(),
                        "blob": leaf.blob,
                        "stored_bytes": stored,
                        "codecs": codecs,
                        "lossy": dict(report) if report is not None else None,
                        # optimizer state: the parameter it belongs to, when the state says
                        "param": next(({"path": params[p], "state": p} for p in _prefixes(path) if p in params), None),
                    }
                )
            return {"commit": commit.id, "tensors": out}

        return self._run(build)

    # ---- diff and storage -------------------------------------------------------------

    def diff(self, a: str, b: str, stat: bool = False) -> dict[str, Any]:
        """``ckvc diff --json [--stat] A B``; the result for a pair of commits is kept
        (commits never change), so a page reads the two commits' tensors once."""
        a, b = check_rev(a, "revision a"), check_rev(b, "revision b")
        key = self._run(lambda repo: (repo.resolve(a), repo.resolve(b), stat))
        with self._lock:
            cached = self._diffs.get(key)
            if cached is not None:
                self._diffs.move_to_end(key)
                return cached
            result = self._run(lambda repo: repo.diff(key[0], key[1], data=not stat).to_json())
            self._diffs[key] = result
            while len(self._diffs) > DIFF_CACHE_SIZE:
                self._diffs.popitem(last=False)
            return result

    def du(self) -> dict[str, Any]:
        """``ckvc du --json``."""
        return self._run(lambda repo: repo.du().to_json())

    def scrub(self) -> dict[str, Any]:
        """``ckvc status --json``'s "scrub": the last complete cycle, the current one's
        coverage and the damage a scrub found (ckvc.scrub)."""
        from ckvc.scrub import SCRUB_FILE, scrub_status

        return self._run(lambda repo: scrub_status(repo.core.local_dir / SCRUB_FILE, len(repo.store.packs())))

    def metrics_text(self) -> str:
        """``GET /metrics``: ckvc.metrics in the Prometheus text format."""
        from ckvc.metrics import collect, prometheus_text

        return self._run(lambda repo: prometheus_text(collect(repo)))

    def retain(self) -> dict[str, Any]:
        """``ckvc retain --dry-run --json`` with the stored policy; with none stored,
        ``policy`` is null (the CLI would refuse) and nothing is planned."""

        def build(repo: Repo) -> dict[str, Any]:
            policy = repo.retention_policy()
            if policy is None:
                return {"policy": None, "kept": {}, "released": [], "already_pruned": [], "dry_run": True}
            return {**repo.retain(policy, dry_run=True).to_json(), "dry_run": True}

        return self._run(build)
