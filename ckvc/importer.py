"""``ckvc import DIR``: a folder of existing checkpoints becomes a linear history.

What counts as a checkpoint (entries directly in DIR; anything else is listed as skipped):

* numbered files: ``epoch_3.pt``, ``ckpt_10.pt``, ``step-400.safetensors``, ``model3.bin``
  (a name ending in a number, with a .pt/.pth/.bin/.ckpt/.safetensors suffix);
* Lightning files: ``epoch=3-step=400.ckpt``, ``epoch=3-val_loss=0.12.ckpt`` (``key=value``
  pairs joined by ``-``, an optional ``-vN`` version suffix; ``last.ckpt`` is skipped, a copy);
* numbered directories: Hugging Face Trainer ``checkpoint-500/``, DCP step directories
  (``step_100/`` holding ``.metadata``), or any numbered folder ``ckvc commit`` can read.

Order is numeric, never lexicographic (``ckpt_2`` before ``ckpt_10``); Lightning files sort by
``step`` when every file has one, else by ``epoch``. All checkpoints must share one naming
scheme (``--glob`` picks one when a folder mixes them), and no two may share a number.

Metrics of each commit, later sources overriding earlier ones:

1. ``trainer_state.json`` inside an HF Trainer folder: every number of its ``log_history``
   entries logged at the folder's ``global_step`` (loss, learning_rate, grad_norm, eval_*),
   plus ``epoch`` and ``step``;
2. the ``key=value`` pairs of a Lightning file name;
3. ``metrics.json`` in DIR: ``{"ckpt_3.pt": {"val_loss": 0.12}, ...}``, keyed by entry name;
4. a sidecar next to the checkpoint with the same stem: ``ckpt_3.json`` for ``ckpt_3.pt``
   (or ``checkpoint-500.json`` for the folder): ``{"val_loss": 0.12, "acc": 0.9}``.

Sidecars map metric names to JSON numbers (bools, strings and nested values are refused).
The commit time is the checkpoint's modification time (the newest file in a folder).

Resuming: each commit records ``ckvc.import.source`` (the entry name), ``ckvc.import.bytes``
and ``ckvc.import.blake3`` (a hash of the entry's bytes; for a folder, of each file's relative
path, size and bytes in path order) in its metadata. A rerun skips every checkpoint already
on the branch with the same name, size and hash, so an interrupted import continues where it
stopped and never duplicates a commit; one whose content changed since, or a new checkpoint
that sorts before one already imported, is refused (ImportConflictError).
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import math
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3

from ckvc.errors import InterruptedOperationError, InvalidInputError
from ckvc.refs import BRANCH_PREFIX, branch_ref

if TYPE_CHECKING:
    from ckvc.repo import Repo

SOURCE_KEY = "ckvc.import.source"
BYTES_KEY = "ckvc.import.bytes"
HASH_KEY = "ckvc.import.blake3"
KIND_KEY = "ckvc.import.kind"
METRICS_FILE = "metrics.json"
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")
HF_TRAINER_STATE = "trainer_state.json"
DCP_METADATA = ".metadata"

_NUMBERED = re.compile(r"^(?P<prefix>(?:.*\D)?)(?P<n>\d+)$")
_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_KEY = r"[A-Za-z_][\w./]*"
_PAIR = re.compile(rf"(?P<key>{_KEY})=(?P<value>{_NUMBER})")
_LIGHTNING = re.compile(rf"^{_KEY}={_NUMBER}(?:-{_KEY}={_NUMBER})*(?:-v\d+)?$")
_LIGHTNING_LAST = re.compile(r"^last(?:-v\d+)?$")  # ModelCheckpoint(save_last=True): a duplicate
_HASH_BLOCK = 1 << 20


class ImportConflictError(InvalidInputError):
    """The folder disagrees with what an earlier import put on the branch: a checkpoint's
    content changed since, or a new checkpoint sorts before one already imported."""


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of the folder, in the order it is committed."""

    name: str  # the entry's name in DIR, recorded as ckvc.import.source
    path: Path
    kind: str  # "file", "lightning", "hf-trainer", "dcp" or "directory"
    order: tuple[int, ...]
    metrics: dict[str, float]
    time_ns: int  # modification time: the commit time
    size: int  # bytes of the file, or of every file in the folder

    @property
    def message(self) -> str:
        return f"import {self.name}"


@dataclass
class ImportPlan:
    directory: Path
    branch: str
    checkpoints: list[Checkpoint]
    skipped: list[tuple[str, str]]  # (entry name, why it is not a checkpoint)
    done: dict[str, str] = field(default_factory=dict)  # name -> commit already on the branch

    @property
    def todo(self) -> list[Checkpoint]:
        return [c for c in self.checkpoints if c.name not in self.done]

    def to_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "branch": self.branch,
            "checkpoints": [
                {
                    "name": c.name,
                    "kind": c.kind,
                    "message": c.message,
                    "metrics": c.metrics,
                    "time_ns": c.time_ns,
                    "bytes": c.size,
                    "commit": self.done.get(c.name),
                }
                for c in self.checkpoints
            ],
            "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
        }


@dataclass
class ImportResult:
    plan: ImportPlan
    imported: dict[str, str]  # name -> new commit id, in commit order
    dry_run: bool

    def to_json(self) -> dict[str, Any]:
        out = self.plan.to_json()
        for entry in out["checkpoints"]:
            name = entry["name"]
            entry["status"] = (
                "already imported" if name in self.plan.done else "would import" if self.dry_run else "imported"
            )
            entry["commit"] = self.plan.done.get(name) or self.imported.get(name)
        out.update(dry_run=self.dry_run, imported=len(self.imported), already_imported=len(self.plan.done))
        return out


def import_checkpoints(
    repo: Repo,
    directory: str | os.PathLike[str],
    *,
    branch: str | None = None,
    glob: str | None = None,
    dry_run: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ImportResult:
    """Commit each checkpoint of ``directory`` in numeric order onto ``branch`` (default:
    HEAD's branch), skipping those an earlier import already committed there.

    HEAD moves to ``branch`` (created as a new root history when it does not exist, like
    ``git switch --orphan``) before the first commit. ``dry_run`` plans without writing
    anything. ``progress(done_bytes, total_bytes)`` follows the checkpoints' file bytes.
    Everything about the folder is checked before the first commit; a checkpoint that
    turns out unreadable stops the import after the ones before it, which a rerun keeps."""
    plan = plan_import(repo, directory, branch=branch, glob=glob)
    if dry_run or not plan.todo:
        return ImportResult(plan, {}, dry_run)
    full = BRANCH_PREFIX + plan.branch
    previous = repo.refs.head()
    if previous[0] != full:
        repo.wait()
        repo.refs.set_head(branch=full, message=f"import: moving to {plan.branch}")
    todo = plan.todo
    imported: dict[str, str] = {}
    try:
        _commit_each(repo, todo, imported, progress)
    except BaseException as exc:
        if not imported and previous[0] != full:  # nothing landed: HEAD goes back where it was
            if previous[0] is not None:
                repo.refs.set_head(branch=previous[0], message="import: nothing imported, moving back")
            elif previous[1] is not None:
                repo.refs.set_head(detached=previous[1], message="import: nothing imported, moving back")
        if isinstance(exc, (KeyboardInterrupt, InterruptedOperationError)):  # a rerun continues from what landed
            raise InterruptedOperationError(
                f"import interrupted after {len(imported)} of {len(todo)} checkpoints "
                f"({len(plan.done) + len(imported)} of {len(plan.checkpoints)} on branch {plan.branch!r}); "
                "run it again to continue"
            ) from None
        if isinstance(exc, InvalidInputError) and imported:
            raise InvalidInputError(
                f"{exc} (imported {len(imported)} checkpoints before it; fix it and run again to continue)"
            ) from None
        raise
    return ImportResult(plan, imported, dry_run)


def _commit_each(
    repo: Repo, todo: list[Checkpoint], imported: dict[str, str], progress: Callable[[int, int], None] | None
) -> None:
    """Commit ``todo`` in order, recording each landed commit in ``imported`` at once.
    ``progress`` reaches the end of a checkpoint's bytes only once its commit landed."""
    from ckvc.formats import read_checkpoint

    total = sum(c.size for c in todo)
    done_bytes = 0
    if progress is not None:
        progress(0, total)
    for ckpt in todo:
        digest = content_hash(ckpt.path)
        state, source_meta = read_checkpoint(ckpt.path)
        metadata = {
            **source_meta,
            SOURCE_KEY: ckpt.name,
            BYTES_KEY: str(ckpt.size),
            HASH_KEY: digest,
            KIND_KEY: ckpt.kind,
        }
        within = _share(progress, done_bytes, ckpt.size, total) if progress is not None else None
        imported[ckpt.name] = repo.commit(
            state,
            message=ckpt.message,
            metrics=ckpt.metrics,
            metadata=metadata,
            time_ns=ckpt.time_ns,
            progress=within,
        )
        del state
        done_bytes += ckpt.size
        if progress is not None:
            progress(done_bytes, total)


def _share(progress: Callable[[int, int], None], start: int, size: int, total: int) -> Callable[[int, int], None]:
    """A commit's own progress scaled into its checkpoint's share of ``total`` and kept
    below the share's end, which is reported once the commit has landed."""

    def update(done: int, of: int) -> None:
        progress(start + (min(size - 1, size * done // of) if of and size else 0), total)

    return update


def plan_import(
    repo: Repo, directory: str | os.PathLike[str], *, branch: str | None = None, glob: str | None = None
) -> ImportPlan:
    """What ``import_checkpoints`` would do; reads the folder's names, sidecars and
    trainer_state.json files (and hashes checkpoints already on the branch), writes nothing."""
    root = Path(directory)
    if not root.is_dir():
        raise InvalidInputError(f"cannot import {root}: not a directory")
    if branch is None:
        target, _ = repo.refs.head()
        if target is None or not target.startswith(BRANCH_PREFIX):
            raise InvalidInputError("HEAD is detached; name the branch to import onto with --branch NAME")
        branch = target[len(BRANCH_PREFIX) :]
    full = branch_ref(branch)
    checkpoints, skipped = scan(root, glob=glob)
    plan = ImportPlan(root, branch, checkpoints, skipped)
    tip = repo.refs.read(full)
    if tip is not None:
        plan.done = _already_imported(repo, tip, checkpoints, branch)
    return plan


def scan(root: Path, *, glob: str | None = None) -> tuple[list[Checkpoint], list[tuple[str, str]]]:
    """The checkpoints of ``root`` in commit order, and the entries that are not checkpoints."""
    named: list[tuple[str, tuple[int, ...], Path, str, dict[str, float]]] = []  # scheme, order, path, kind, metrics
    skipped: list[tuple[str, str]] = []
    sidecar_names: set[str] = set()
    entries = sorted(root.iterdir(), key=lambda p: p.name)
    file_stems = {p.stem for p in entries if p.is_file() and p.suffix in CHECKPOINT_SUFFIXES}
    dir_names = {p.name for p in entries if p.is_dir()}
    for p in entries:
        if p.suffix == ".json" and p.is_file() and (p.stem in file_stems or p.stem in dir_names):
            sidecar_names.add(p.name)
    for p in entries:
        name = p.name
        if name.startswith(".") or name == METRICS_FILE or name in sidecar_names:
            continue
        if glob is not None and not fnmatch.fnmatchcase(name, glob):
            skipped.append((name, f"does not match --glob {glob}"))
            continue
        found = _classify(p)
        if isinstance(found, str):
            skipped.append((name, found))
        else:
            named.append(found)
    if not named:
        raise InvalidInputError(
            f"no checkpoints in {root}: looked for numbered .pt/.pth/.bin/.ckpt/.safetensors files "
            "(epoch_3.pt, ckpt_10.pt), Lightning files (epoch=3-step=400.ckpt) and numbered folders "
            "(checkpoint-500/, step_100/)" + (f" matching {glob}" if glob else "")
        )
    schemes: dict[str, int] = {}
    for scheme, *_ in named:
        schemes[scheme] = schemes.get(scheme, 0) + 1
    if len(schemes) > 1:
        listed = ", ".join(f"{s}: {n}" for s, n in sorted(schemes.items()))
        raise InvalidInputError(f"{root} mixes checkpoint names ({listed}); choose one with --glob PATTERN")
    if next(iter(schemes)) == "lightning":
        named = [(s, _lightning_order(p, m), p, k, m) for s, _, p, k, m in named]
        _check_lightning_keys(named)
    named.sort(key=lambda e: e[1])
    for (_, o1, p1, *_), (_, o2, p2, *_) in itertools.pairwise(named):
        if o1 == o2:
            raise InvalidInputError(f"{p1.name} and {p2.name} have the same number: their order is ambiguous")
    shared = _read_metrics_file(root)
    checkpoints = []
    for _, order, path, kind, metrics in named:
        metrics = {**metrics, **shared.get(path.name, {})}
        sidecar = path.parent / f"{path.stem if path.is_file() else path.name}.json"
        if sidecar.name in sidecar_names:
            metrics.update(_read_sidecar(sidecar))
        size, time_ns = _size_and_time(path)
        if size == 0 and path.is_file():  # found now, not after the commits before it
            raise InvalidInputError(f"{path} is empty (0 bytes): nothing to commit")
        checkpoints.append(Checkpoint(path.name, path, kind, order, metrics, time_ns, size))
    unknown = set(shared) - {c.name for c in checkpoints}
    if unknown:
        raise InvalidInputError(
            f"{root / METRICS_FILE} names entries that are not checkpoints here: {', '.join(sorted(unknown))}"
        )
    return checkpoints, skipped


def _classify(p: Path) -> tuple[str, tuple[int, ...], Path, str, dict[str, float]] | str:
    """(scheme, order, path, kind, metrics), or why ``p`` is not a checkpoint."""
    if p.is_symlink():
        return "a symbolic link"
    if p.is_file():
        if p.suffix not in CHECKPOINT_SUFFIXES:
            return "not a checkpoint file"
        if p.suffix == ".ckpt" and _LIGHTNING_LAST.match(p.stem):
            return "Lightning's copy of the latest checkpoint"
        if _LIGHTNING.match(p.stem):
            return ("lightning", (), p, "lightning", _lightning_metrics(p))
        m = _NUMBERED.match(p.stem)
        if m is None:
            return "no number in its name"
        return (f"{m['prefix']}*{p.suffix}", (int(m["n"]),), p, "file", {})
    if p.is_dir():
        m = _NUMBERED.match(p.name)
        if m is None:
            return "a folder with no number in its name"
        kind = "directory"
        metrics: dict[str, float] = {}
        if (p / HF_TRAINER_STATE).is_file():
            kind = "hf-trainer"
            metrics = _trainer_state_metrics(p / HF_TRAINER_STATE)
        elif (p / DCP_METADATA).is_file():
            kind = "dcp"
        return (f"{m['prefix']}*/", (int(m["n"]),), p, kind, metrics)
    return "not a regular file or folder"


def _lightning_metrics(p: Path) -> dict[str, float]:
    return {m["key"]: float(m["value"]) for m in _PAIR.finditer(p.stem)}


def _lightning_order(p: Path, metrics: dict[str, float]) -> tuple[int, ...]:
    version = re.search(r"-v(\d+)$", p.stem)
    keys = tuple(int(metrics[k]) for k in ("step", "epoch") if k in metrics)
    return (*keys, int(version[1]) if version else 0)


def _check_lightning_keys(named: list[tuple[str, tuple[int, ...], Path, str, dict[str, float]]]) -> None:
    """Lightning files order by step, else by epoch; every file must carry the key used."""
    has_step = [("step" in m) for *_, m in named]
    if all(has_step):
        return
    if any(has_step):
        missing = next(p.name for (_, _, p, _, m) in named if "step" not in m)
        raise InvalidInputError(f"{missing} has no step= in its name, other Lightning files do: order is ambiguous")
    missing_epoch = [p.name for (_, _, p, _, m) in named if "epoch" not in m]
    if missing_epoch:
        raise InvalidInputError(f"{missing_epoch[0]} has neither step= nor epoch= in its name: no order")


def _trainer_state_metrics(path: Path) -> dict[str, float]:
    """The numbers an HF Trainer logged at the checkpoint's global step."""
    state = _load_json(path)
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise InvalidInputError(f"{path}: not a Trainer state (no integer global_step)")
    return trainer_log_metrics(state)


def trainer_log_metrics(state: dict[str, Any]) -> dict[str, float]:
    """The numbers of a Trainer state (``trainer_state.json`` as a dict) logged at its
    ``global_step``, plus ``epoch`` and ``step``: a commit's metrics (also
    ckvc.integrations.transformers's)."""
    step = state["global_step"]
    out: dict[str, float] = {}
    for entry in state.get("log_history") or []:
        if isinstance(entry, dict) and entry.get("step") == step:
            out.update({k: float(v) for k, v in entry.items() if _is_number(v) and k != "step"})
    if _is_number(state.get("epoch")):
        out["epoch"] = float(state["epoch"])
    out["step"] = float(step)
    return out


def _read_metrics_file(root: Path) -> dict[str, dict[str, float]]:
    path = root / METRICS_FILE
    if not path.is_file():
        return {}
    data = _load_json(path)
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise InvalidInputError(f"{path}: expected an object mapping checkpoint names to objects of metrics")
    return {name: _metrics_object(path, value, f"{name}.") for name, value in data.items()}


def _read_sidecar(path: Path) -> dict[str, float]:
    data = _load_json(path)
    if not isinstance(data, dict):
        raise InvalidInputError(f"{path}: expected an object mapping metric names to numbers")
    return _metrics_object(path, data, "")


def _metrics_object(path: Path, data: dict[str, Any], where: str) -> dict[str, float]:
    for key, value in data.items():
        if not _is_number(value) or not key:
            raise InvalidInputError(f"{path}: metric {where}{key!r} must be a number, got {value!r}")
    return {k: float(v) for k, v in data.items()}


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_bytes(), parse_constant=lambda c: math.nan if c == "NaN" else float(c))
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"cannot read {path} as JSON: {exc}") from None


def _files(path: Path) -> list[Path]:
    """A checkpoint's regular files (and links), in relative-path order."""
    if not path.is_dir():
        return [path]
    found: list[Path] = []
    for dirpath, dirs, files in os.walk(path):
        dirs.sort()
        found.extend(Path(dirpath, f) for f in files)
        found.extend(Path(dirpath, d) for d in dirs if Path(dirpath, d).is_symlink())
    return sorted(found, key=lambda f: f.relative_to(path).as_posix())


def _size_and_time(path: Path) -> tuple[int, int]:
    size, mtime = 0, 0
    for f in _files(path):
        st = f.lstat()
        size += st.st_size
        mtime = max(mtime, st.st_mtime_ns)
    return size, mtime or path.stat().st_mtime_ns


def content_hash(path: Path) -> str:
    """BLAKE3 of a file's bytes; for a folder, of each file's relative path, size and bytes."""
    h = blake3.blake3()
    for f in _files(path):
        if path.is_dir():
            rel = f.relative_to(path).as_posix().encode("utf-8", "surrogateescape")
            h.update(struct.pack("<Q", len(rel)) + rel)
        if f.is_symlink():
            h.update(b"L" + os.readlink(f).encode("utf-8", "surrogateescape"))
            continue
        h.update(struct.pack("<Q", f.stat().st_size))
        with open(f, "rb") as fh:
            while block := fh.read(_HASH_BLOCK):
                h.update(block)
    return h.hexdigest()


def _already_imported(repo: Repo, tip: str, checkpoints: list[Checkpoint], branch: str) -> dict[str, str]:
    """name -> commit for the checkpoints an earlier import put on the branch."""
    records: dict[str, tuple[str, str, str]] = {}  # name -> (bytes, hash, commit)
    for commit in repo.log(tip, first_parent=True):
        name = commit.metadata.get(SOURCE_KEY)
        if isinstance(name, str) and name not in records:
            records[name] = (str(commit.metadata.get(BYTES_KEY)), str(commit.metadata.get(HASH_KEY)), commit.id)
    done: dict[str, str] = {}
    last_done = -1
    for i, ckpt in enumerate(checkpoints):
        if ckpt.name not in records:
            continue
        size, digest, commit_id = records[ckpt.name]
        if size != str(ckpt.size) or digest != content_hash(ckpt.path):
            raise ImportConflictError(
                f"{ckpt.name} changed since it was imported as commit {commit_id[:12]} on branch {branch!r}; "
                "import into another branch with --branch NAME"
            )
        done[ckpt.name] = commit_id
        last_done = i
    late = [c.name for c in checkpoints[:last_done] if c.name not in done]
    if late:
        raise ImportConflictError(
            f"{late[0]} sorts before {checkpoints[last_done].name}, which is already imported on branch "
            f"{branch!r}: the history would be out of order; import into another branch with --branch NAME"
        )
    return done
