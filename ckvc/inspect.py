"""What a commit holds and what changed, without loading it (show, diff), and
where the bytes go (du): logical vs stored bytes, dedup and compression, unique
bytes per commit, breakdowns by top-level key and by codec. Results are
dataclasses; the CLI renders them."""

from __future__ import annotations

import datetime as dt
import fnmatch
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ckvc import graph, signing
from ckvc.codecs import CODEC_NAMES
from ckvc.core import Repository
from ckvc.objects import Commit, Snapshot

if TYPE_CHECKING:
    from ckvc.notes import Note
    from ckvc.objects import Tag
    from ckvc.pruned import PruneRecord
    from ckvc.state import TensorInfo


# ---- JSON: what `ckvc log|show|diff --json` print and `ckvc serve` answers --------


def time_text(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# An int past this many bits is shown by its size: Python refuses to print one of
# more than 4,300 digits (CVE-2020-10735), and nobody reads one of 300.
INT_BITS_SHOWN = 1000
TEXT_SHOWN = 1000  # characters of a string, items of a list or map, before "…"


def big_int_text(v: int) -> str:
    return f"<int of {v.bit_length():,} bits>"


def jsonable(v: Any) -> Any:
    """Non-tensor state values for JSON output."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > INT_BITS_SHOWN:
        return big_int_text(v)
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else repr(v)
    if isinstance(v, bytes):
        return {"bytes": len(v)}
    if type(v).__module__ == "numpy" and hasattr(v, "item"):  # a numpy scalar; numpy itself stays unimported
        return jsonable(v.item())
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return str(v)


def value_text(v: Any, width: int = 100) -> str:
    """A non-tensor value as one line of at most about ``width`` characters, whatever
    its size: a big int by its bits, bytes by their length, a long string or
    container cut with "…" and what was left out; never builds the whole repr."""

    def text(x: Any, budget: int) -> str:
        if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > INT_BITS_SHOWN:
            return big_int_text(x)
        if isinstance(x, str) and len(x) > budget:
            return f"{x[: max(budget - 24, 8)]!r}… ({len(x):,} chars)"
        if isinstance(x, bytes | bytearray | memoryview):
            return f"<{len(x):,} bytes>" if len(x) > budget // 4 else repr(bytes(x))
        if isinstance(x, list | tuple | dict):
            items = list(x.items()) if isinstance(x, dict) else list(x)
            parts: list[str] = []
            used = 0
            for item in items:
                if used > budget:
                    parts.append(f"… {len(items) - len(parts)} more")
                    break
                part = (
                    f"{text(item[0], budget)}: {text(item[1], budget)}" if isinstance(x, dict) else text(item, budget)
                )
                parts.append(part)
                used += len(part) + 2
            inner = ", ".join(parts)
            if isinstance(x, dict):
                return "{" + inner + "}"
            return f"({inner}{',' if len(items) == 1 else ''})" if isinstance(x, tuple) else f"[{inner}]"
        return repr(x)

    out = text(v, width)
    return out if len(out) <= width else out[: width - 1] + "…"


def fields_json(report: Any, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A result dataclass's fields as JSON, shallow; ``skip``: those its
    ``to_json`` renders itself."""
    return {f.name: getattr(report, f.name) for f in fields(report) if f.name not in skip}


def commit_json(c: Commit) -> dict[str, Any]:
    return {
        "id": c.id,
        "parents": list(c.parents),
        "author": c.author,
        "time": time_text(c.time_ns),
        "time_ns": c.time_ns,
        "message": c.message,
        "metrics": {k: jsonable(v) for k, v in c.metrics.items()},
        "metadata": jsonable(dict(c.metadata)),
        "pickled": c.pickled,
        "lossy": {path: dict(report) for path, report in c.lossy.items()},
    }


def history_json(core: Repository, commits: Sequence[Commit]) -> list[dict[str, Any]]:
    """``ckvc log --json`` (and the web UI's log): each commit with its prune record,
    its signature's verdict (ckvc.signing.signatures_json) and its notes, in log order."""
    from ckvc import notes, signing

    signatures = signing.signatures_json(core, [c.id for c in commits])
    noted = notes.all_notes(core)
    return [
        {**entry, "signature": signatures[entry["id"]], "notes": [note_json(n) for n in noted.get(entry["id"], ())]}
        for entry in log_json(commits, core.pruned())
    ]


def show_extras_json(core: Repository, commit_id: str, tag_id: str | None) -> dict[str, Any]:
    """What ``ckvc show --json`` adds to CommitInfo.to_json: signatures and notes."""
    from ckvc import notes, signing

    return {
        **signing.show_json(core, commit_id, tag_id),
        "notes": [note_json(n) for n in notes.notes_of(core, commit_id)],
    }


def log_json(commits: Iterable[Commit], pruned: Mapping[str, PruneRecord]) -> list[dict[str, Any]]:
    """``ckvc log --json``: each commit, with when and by which policy it was pruned."""
    return [
        {
            **commit_json(c),
            "pruned": (
                {"policy": pruned[c.id].policy, "time": time_text(pruned[c.id].time_ns)} if c.id in pruned else None
            ),
        }
        for c in commits
    ]


def note_json(note: Note) -> dict[str, Any]:
    """A note (ckvc.notes) as ``log --json``, ``show --json`` and the web UI give it."""
    return {
        "id": note.id,
        "author": note.author,
        "time": time_text(note.time_ns),
        "time_ns": note.time_ns,
        "message": note.message,
        "metrics": {k: jsonable(v) for k, v in note.metrics.items()},
        "metadata": jsonable(dict(note.metadata)),
    }


def tag_json(t: Tag) -> dict[str, Any]:
    return {
        "name": t.name,
        "id": t.id,
        "target": t.target,
        "tagger": t.tagger,
        "time": time_text(t.time_ns),
        "message": t.message,
    }


@dataclass
class CommitUsage:
    commit: str
    message: str
    logical_bytes: int
    unique_stored_bytes: int  # chunks no other live commit uses: what pruning it would free
    pruned: bool = False


@dataclass
class KeyUsage:
    key: str  # top-level key of the state ("model", "optimizer", ...)
    logical_bytes: int = 0  # over every live commit
    unique_raw_bytes: int = 0  # distinct chunks first seen under this key
    stored_bytes: int = 0  # their stored size


@dataclass
class CodecUsage:
    """Distinct chunks stored with one codec: their plain and stored bytes."""

    chunks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.stored_bytes / self.raw_bytes if self.raw_bytes else 1.0


def codecs_json(by_codec: Mapping[str, CodecUsage]) -> dict[str, Any]:
    return {name: {**asdict(c), "ratio": c.ratio} for name, c in by_codec.items()}


def codec_usage(repo: Repository, chunk_ids: Iterable[bytes]) -> dict[str, CodecUsage]:
    """Stored bytes per codec over distinct chunks, largest first."""
    usage: dict[str, CodecUsage] = {}
    for oid in chunk_ids:
        st = repo.store.stat(oid)
        entry = usage.setdefault(CODEC_NAMES.get(st.codec, str(st.codec)), CodecUsage())
        entry.chunks += 1
        entry.raw_bytes += st.raw_size
        entry.stored_bytes += st.stored_size
    return dict(sorted(usage.items(), key=lambda kv: -kv[1].stored_bytes))


@dataclass
class DiskUsage:
    commits: int = 0
    pruned_commits: int = 0
    logical_bytes: int = 0  # sum of every live (unpruned, reachable) commit's tensor bytes
    unique_raw_bytes: int = 0  # distinct chunks, before compression
    stored_chunk_bytes: int = 0  # distinct chunks as stored (compressed, with record headers)
    pack_bytes: int = 0  # all pack files on disk, reachable or not
    pack_count: int = 0
    per_commit: list[CommitUsage] = field(default_factory=list)
    by_key: list[KeyUsage] = field(default_factory=list)
    by_codec: dict[str, CodecUsage] = field(default_factory=dict)

    @property
    def dedup_ratio(self) -> float:
        return self.logical_bytes / self.unique_raw_bytes if self.unique_raw_bytes else 1.0

    @property
    def compression_ratio(self) -> float:
        return self.unique_raw_bytes / self.stored_chunk_bytes if self.stored_chunk_bytes else 1.0

    @property
    def total_ratio(self) -> float:
        return self.logical_bytes / self.pack_bytes if self.pack_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(dedup_ratio=self.dedup_ratio, compression_ratio=self.compression_ratio, total_ratio=self.total_ratio)
        for name, codec in self.by_codec.items():
            out["by_codec"][name]["ratio"] = codec.ratio
        return out


def disk_usage(repo: Repository) -> DiskUsage:
    """Logical vs stored bytes, dedup and compression ratios, unique bytes per commit."""
    usage = DiskUsage()
    pruned = repo.pruned()
    per_commit_chunks: list[tuple[str, str, int, set[bytes]]] = []
    refcount: Counter[bytes] = Counter()
    first_key: dict[bytes, str] = {}
    keys: dict[str, KeyUsage] = {}
    for commit in graph.iter_reachable_commits(repo, graph.ref_tips(repo, include_reflogs=False)):
        if commit.id in pruned:
            usage.pruned_commits += 1
            usage.per_commit.append(CommitUsage(commit.id, commit.message, 0, 0, pruned=True))
            continue
        snapshot = repo.read_snapshot(commit)
        chunks: set[bytes] = set()
        for blob in snapshot.blobs:
            key = blob.path.split(".", 1)[0]
            keys.setdefault(key, KeyUsage(key)).logical_bytes += blob.nbytes
            for oid in blob.chunks:
                chunks.add(oid)
                first_key.setdefault(oid, key)
        logical = sum(blob.nbytes for blob in snapshot.blobs)
        per_commit_chunks.append((commit.id, commit.message, logical, chunks))
        refcount.update(chunks)
        usage.commits += 1
        usage.logical_bytes += logical
    sizes: dict[bytes, int] = {}
    for oid in refcount:
        st = repo.store.stat(oid)
        sizes[oid] = st.stored_size
        usage.unique_raw_bytes += st.raw_size
        usage.stored_chunk_bytes += st.stored_size
        key_usage = keys[first_key[oid]]
        key_usage.unique_raw_bytes += st.raw_size
        key_usage.stored_bytes += st.stored_size
    for cid, message, logical, chunks in per_commit_chunks:
        unique = sum(sizes[o] for o in chunks if refcount[o] == 1)
        usage.per_commit.append(CommitUsage(cid, message, logical, unique))
    usage.by_key = sorted(keys.values(), key=lambda k: -k.stored_bytes)
    usage.by_codec = codec_usage(repo, refcount)
    for name in repo.store.packs():
        usage.pack_count += 1
        info = repo.store.pack_info(name)
        usage.pack_bytes += info.size if info is not None else 0
    return usage


# ---- show -----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSummary:
    path: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    kind: str  # "tensor", "parameter" or "numpy"

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "kind": self.kind,
        }


@dataclass
class CommitInfo:
    commit: Commit
    tensors: list[TensorSummary]
    values: dict[str, Any]  # non-tensor leaves by path
    logical_bytes: int
    stored_bytes: int  # stored size of the chunks this commit uses (shared ones included)
    by_codec: dict[str, CodecUsage] = field(default_factory=dict)  # over the same chunks
    blobs: int = 0  # stored byte buffers (tensors sharing storage share one)

    def to_json(self, tag: Tag | None = None, *, tensors: bool = True) -> dict[str, Any]:
        """``ckvc show --json`` (``tensors=False``: ``--no-data``, no tensor list or values)."""
        out: dict[str, Any] = {
            **commit_json(self.commit),
            "tag": tag_json(tag) if tag else None,
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "by_codec": codecs_json(self.by_codec),
        }
        if tensors:
            out["tensors"] = [t.to_json() for t in self.tensors]
            out["values"] = {k: jsonable(v) for k, v in self.values.items()}
        return out


def tensor_summary(path: str, info: TensorInfo, snapshot: Snapshot) -> TensorSummary:
    """dtype, shape, size and kind of the tensor ``info`` describes, from the snapshot alone."""
    from ckvc import state as state_mod

    blob = snapshot.blobs[info.blob]
    itemsize = state_mod.blob_itemsize(blob.dtype)
    kind = {state_mod.KIND_TENSOR: "tensor", state_mod.KIND_PARAMETER: "parameter"}.get(info.kind, "numpy")
    dtype = blob.dtype.removeprefix(state_mod.NUMPY_DTYPE_PREFIX)
    return TensorSummary(path, dtype, info.shape, info.numel * itemsize, kind)


def show(core: Repository, commit_id: str, *, tensors: bool = True) -> CommitInfo:
    """The commit with its tensors (dtype, shape, size), non-tensor values and
    stored sizes; reads no tensor data. ``tensors=False`` skips parsing the state
    (empty ``tensors`` and ``values``; torch is not imported). Pruned commits are refused."""
    commit = core.read_commit(commit_id)
    graph.check_not_pruned(core, commit.id)
    snapshot = core.read_snapshot(commit)
    summaries: list[TensorSummary] = []
    values: dict[str, Any] = {}
    if tensors:
        from ckvc import state as state_mod
        from ckvc.state import TensorInfo

        leaves = state_mod.flatten(state_mod.parse_snapshot(snapshot, commit.id, allow_pickle=None).build())
        for path, leaf in leaves.items():
            if isinstance(leaf, TensorInfo):
                summaries.append(tensor_summary(path, leaf, snapshot))
            else:
                values[path] = leaf
    used = {oid for b in snapshot.blobs for oid in b.chunks}
    by_codec = codec_usage(core, used)
    stored = sum(c.stored_bytes for c in by_codec.values())
    logical = sum(b.nbytes for b in snapshot.blobs)
    return CommitInfo(commit, summaries, values, logical, stored, by_codec, len(snapshot.blobs))


# ---- optimizer state under parameter names ------------------------------------------

# Tie-break when several sibling state dicts align with one optimizer (an EMA copy has
# the model's shapes): the conventional names of the trained model.
MODEL_KEYS = ("model", "state_dict", "module", "model_state_dict", "net")

Shape = tuple[int, ...]
Wanted = list[tuple[Any, Shape | None]]  # (optimizer state id, the shape its state requires)


def parameter_names(state: Any, snapshot: Snapshot) -> dict[str, str]:
    """``{"optimizer.state.3": "model.fc.weight", ...}``: for each torch optimizer state
    dict in ``state`` (a skeleton, TensorInfo for tensors), the path of the parameter
    behind each numeric state id.

    torch numbers parameters in ``param_groups`` order, which is the model's
    ``parameters()`` order: the floating tensors of a state dict in order, minus the
    buffers between them. So the ids are matched against the nearest sibling dict's
    floating tensors as an ordered subsequence, each id with saved state needing the
    parameter's shape. A mapping is given only when exactly one such subsequence exists
    (the leftmost and the rightmost matches agree) in exactly one sibling (or one named
    like a model, MODEL_KEYS); anything else keeps its plain path. Files inside a
    committed folder are not searched: a .safetensors file does not keep that order."""
    from ckvc.state import TORCH_DTYPES, TensorInfo
    from ckvc.state.parse import join_path

    def is_float(info: TensorInfo) -> bool:
        dtype = TORCH_DTYPES.get(snapshot.blobs[info.blob].dtype)
        return dtype is not None and (dtype.is_floating_point or dtype.is_complex)

    def floating_tensors(value: Any, path: str) -> list[tuple[str, Shape]]:
        out: list[tuple[str, Shape]] = []

        def walk(v: Any, p: str) -> None:
            if isinstance(v, dict):
                for k, x in v.items():
                    walk(x, join_path(p, k))
            elif isinstance(v, (list, tuple)):
                for i, x in enumerate(v):
                    walk(x, join_path(p, i))
            elif isinstance(v, TensorInfo) and is_float(v):
                out.append((p, v.shape))

        walk(value, path)
        return out

    def wanted_shapes(optimizer: dict[Any, Any]) -> Wanted | None:
        """(state id, shape its saved tensors require) in parameter order; None when
        this is not a well-formed optimizer state dict."""
        groups = optimizer["param_groups"]
        if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
            return None
        ids = [p for g in groups for p in g["params"]]
        saved = optimizer["state"]
        if not ids or not all(isinstance(p, int) for p in ids) or len(set(ids)) != len(ids):
            return None
        if not isinstance(saved, dict) or not set(saved) <= set(ids):
            return None
        if not all(isinstance(v, dict) for v in saved.values()):
            return None
        out: Wanted = []
        for p in ids:
            shapes = {v.shape for v in saved.get(p, {}).values() if isinstance(v, TensorInfo) and v.shape}
            if len(shapes) > 1:
                return None
            out.append((p, shapes.pop() if shapes else None))
        return out

    def align(wanted: Wanted, tensors: list[tuple[str, Shape]]) -> list[str] | None:
        def fits(w: Shape | None, shape: Shape) -> bool:
            return w is None or w == shape

        def greedy(ws: list[Shape | None], ts: list[Shape]) -> list[int] | None:
            picks, j = [], 0
            for w in ws:
                while j < len(ts) and not fits(w, ts[j]):
                    j += 1
                if j == len(ts):
                    return None
                picks.append(j)
                j += 1
            return picks

        shapes = [w for _, w in wanted]
        left = greedy(shapes, [s for _, s in tensors])
        right = greedy(shapes[::-1], [s for _, s in tensors][::-1])
        if left is None or right is None:
            return None
        if left == [len(tensors) - 1 - j for j in reversed(right)]:
            return [tensors[j][0] for j in left]  # the only way to match
        # Buffers with a parameter's shape (BatchNorm's running stats) make several
        # matches possible. The leftmost is torch's order when every tensor it skips sits
        # where state_dict puts buffers, after a matched parameter of its own module, or
        # fits no parameter; otherwise (a frozen layer shaped like a trained one) say
        # nothing rather than guess.
        matched = set(left)
        modules_seen: set[str] = set()
        wanted_shapes_set = {w for w in shapes if w is not None}
        for j, (name, shape) in enumerate(tensors):
            module = name.rpartition(".")[0]
            if j in matched:
                modules_seen.add(module)
            elif module not in modules_seen and (shape in wanted_shapes_set or None in shapes):
                return None
        return [tensors[j][0] for j in left]

    found: dict[str, str] = {}

    def visit(value: Any, path: str, ancestors: list[tuple[str, Any]]) -> None:
        is_optimizer = isinstance(value, dict) and {"state", "param_groups"} <= set(value)
        if is_optimizer and isinstance(value["param_groups"], list):
            wanted = wanted_shapes(value)
            if wanted is not None:
                name_map = nearest_model(wanted, path, ancestors)
                if name_map is not None:
                    for (state_id, _), param in zip(wanted, name_map, strict=True):
                        found[join_path(join_path(path, "state"), state_id)] = param
            return
        children = (
            value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
        )
        for k, x in children:
            visit(x, join_path(path, k), [*ancestors, (path, value)])

    def nearest_model(wanted: Wanted, path: str, ancestors: list[tuple[str, Any]]) -> list[str] | None:
        for anc_path, anc in reversed(ancestors):
            matches: dict[str, list[str]] = {}
            if not isinstance(anc, dict):
                continue
            for k, sibling in anc.items():
                sib_path = join_path(anc_path, k)
                if path == sib_path or path.startswith(sib_path + ".") or not isinstance(sibling, dict):
                    continue
                names = align(wanted, floating_tensors(sibling, sib_path))
                if names is not None:
                    matches[str(k)] = names
            if len(matches) > 1:
                preferred = [k for k in MODEL_KEYS if k in matches]
                return matches[preferred[0]] if len(preferred) == 1 else None
            if matches:
                return next(iter(matches.values()))
        return None

    visit(state, "", [])
    return found


# ---- diff -----------------------------------------------------------------------


@dataclass(frozen=True)
class TensorChange:
    path: str
    old: TensorSummary
    new: TensorSummary
    rel_l2: float | None  # ||new - old|| / ||old||; None when shapes or dtypes differ
    max_abs: float | None


@dataclass
class StateDiff:
    """What changed from commit ``a`` to ``b``. ``changed`` comes largest relative
    change first (shape or dtype changes, which have none, before all others);
    tensors and values under an RNG state (``is_rng_path``) are not listed one by
    one but counted in ``rng_changed``, since they change on every step."""

    a: str
    b: str
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[TensorChange] = field(default_factory=list)
    values_changed: list[tuple[str, Any, Any]] = field(default_factory=list)
    metrics_changed: list[tuple[str, float | None, float | None]] = field(default_factory=list)
    added_bytes: int = 0
    removed_bytes: int = 0
    changed_bytes: int = 0  # bytes of the changed tensors (new side)
    unchanged: int = 0  # tensors identical in both
    rng_changed: list[str] = field(default_factory=list)  # RNG-state leaves that differ

    def to_json(self) -> dict[str, Any]:
        """``ckvc diff --json``."""
        return {
            "a": self.a,
            "b": self.b,
            "summary": {
                "changed": len(self.changed),
                "added": len(self.added),
                "removed": len(self.removed),
                "unchanged": self.unchanged,
                "changed_bytes": self.changed_bytes,
                "added_bytes": self.added_bytes,
                "removed_bytes": self.removed_bytes,
                "values_changed": len(self.values_changed),
                "rng_changed": len(self.rng_changed),
            },
            "metrics_changed": [
                {"name": n, "old": jsonable(x), "new": jsonable(y)} for n, x, y in self.metrics_changed
            ],
            "added": self.added,
            "removed": self.removed,
            "changed": [
                {
                    "path": c.path,
                    "old": c.old.to_json(),
                    "new": c.new.to_json(),
                    "rel_l2": jsonable(c.rel_l2),
                    "max_abs": jsonable(c.max_abs),
                }
                for c in self.changed
            ],
            "values_changed": [{"path": p, "old": jsonable(x), "new": jsonable(y)} for p, x, y in self.values_changed],
            "rng_changed": self.rng_changed,
        }


_RNG_PART = re.compile(r"(?i)^(rng|rng_states?|random_states?|generator|rng_state(_\d+)?(\.pth)?)$")


def is_rng_path(path: str) -> bool:
    """Whether a state path lies under an RNG state (``ckvc.rng_state()`` saved as
    "rng", Hugging Face's "rng_state.pth", a "generator"): noise, not training."""
    return any(_RNG_PART.match(part) for part in re.split(r"[./]", path)) or "rng_state" in path


def _matches(path: str, patterns: Sequence[str]) -> bool:
    """``path`` is one of ``patterns``, lies under one ("model" covers "model.w"), or
    matches one as a glob ("*.weight")."""
    return any(path == p or path.startswith(p.rstrip(".") + ".") or fnmatch.fnmatchcase(path, p) for p in patterns)


def diff(core: Repository, a: str, b: str, paths: Sequence[str] = (), *, data: bool = True) -> StateDiff:
    """Tensors added, removed and changed from commit ``a`` to commit ``b`` (with
    relative L2 change and max abs difference), changed non-tensor values and
    metrics. ``paths``: only leaves equal to, under, or matching (glob) one of them.
    ``data=False`` reads no tensor bytes (no rel_l2 / max_abs: ``--stat``)."""
    from ckvc import state as state_mod
    from ckvc.state import TensorInfo

    ca, cb = core.read_commit(a), core.read_commit(b)
    graph.check_not_pruned(core, ca.id)
    graph.check_not_pruned(core, cb.id)
    if data:  # tensor values are compared: read as every read is, under require_signatures
        signing.require_signed(core, ca.id)
        signing.require_signed(core, cb.id)
    sa, sb = core.read_snapshot(ca), core.read_snapshot(cb)
    la = state_mod.flatten(state_mod.parse_snapshot(sa, ca.id, allow_pickle=None).build())
    if (
        sa.tree == sb.tree
        and len(sa.blobs) == len(sb.blobs)
        and all((x.dtype, x.nbytes) == (y.dtype, y.nbytes) for x, y in zip(sa.blobs, sb.blobs, strict=True))
    ):
        # The same structure over blobs of the same dtypes and sizes (most steps of
        # a run): the same leaves, every check passed alike; only the blobs' bytes
        # differ, which the loop below compares.
        lb = la
    else:
        lb = state_mod.flatten(state_mod.parse_snapshot(sb, cb.id, allow_pickle=None).build())
    result = StateDiff(ca.id, cb.id)
    if paths:
        la = {p: v for p, v in la.items() if _matches(p, paths)}
        lb = {p: v for p, v in lb.items() if _matches(p, paths)}
    for name in sorted(set(ca.metrics) | set(cb.metrics)):
        old, new = ca.metrics.get(name), cb.metrics.get(name)
        if not _same_value(old, new):
            result.metrics_changed.append((name, old, new))

    def size(leaves: Mapping[str, Any], snapshot: Snapshot, path: str) -> int:
        leaf = leaves[path]
        return tensor_summary(path, leaf, snapshot).nbytes if isinstance(leaf, TensorInfo) else 0

    # RNG states are counted apart, in rng_changed only
    for path in lb:
        if path not in la:
            if is_rng_path(path):
                result.rng_changed.append(path)
            else:
                result.added.append(path)
                result.added_bytes += size(lb, sb, path)
    for path in la:
        if path not in lb:
            if is_rng_path(path):
                result.rng_changed.append(path)
            else:
                result.removed.append(path)
                result.removed_bytes += size(la, sa, path)
    for path in (p for p in la if p in lb):
        va, vb = la[path], lb[path]
        if isinstance(va, TensorInfo) and isinstance(vb, TensorInfo):
            blob_a, blob_b = sa.blobs[va.blob], sb.blobs[vb.blob]
            same_view = (va.shape, va.stride, va.offset, va.kind) == (vb.shape, vb.stride, vb.offset, vb.kind)
            if same_view and (blob_a.dtype, blob_a.chunks) == (blob_b.dtype, blob_b.chunks):
                result.unchanged += 1
                continue
            if is_rng_path(path):
                result.rng_changed.append(path)
                continue
            if data:
                change = _tensor_change(core, path, ca, sa, va, cb, sb, vb)
                if change is None:  # the same bytes, stored another way (a .pt's shared storage, a .safetensors)
                    result.unchanged += 1
                    continue
                result.changed_bytes += size(lb, sb, path)
                result.changed.append(change)
            else:
                result.changed_bytes += size(lb, sb, path)
                before, after = tensor_summary(path, va, sa), tensor_summary(path, vb, sb)
                result.changed.append(TensorChange(path, before, after, None, None))
        elif isinstance(va, TensorInfo) or isinstance(vb, TensorInfo) or not _same_value(va, vb):
            if is_rng_path(path):
                result.rng_changed.append(path)
            else:
                result.values_changed.append((path, _display_value(va), _display_value(vb)))
    # largest relative change first; shape/dtype changes (no rel_l2) lead, as the biggest change of all
    result.changed.sort(key=lambda c: -math.inf if c.rel_l2 is None else -c.rel_l2)
    return result


def load_tensor(core: Repository, commit: Commit, snapshot: Snapshot, info: TensorInfo) -> Any:
    """One tensor of ``commit``, read and verified (its whole blob)."""
    from ckvc import state as state_mod
    from ckvc.read import read_blobs

    (base,) = read_blobs(core, commit, [snapshot.blobs[info.blob]])
    return state_mod.materialize(info, base)


def _tensor_change(
    core: Repository, path: str, ca: Commit, sa: Snapshot, va: TensorInfo, cb: Commit, sb: Snapshot, vb: TensorInfo
) -> TensorChange | None:
    """How the tensor at ``path`` changed; None when its dtype, shape and bytes are
    the same (stored differently, e.g. once inside a .pt, once in a .safetensors)."""
    import numpy as np
    import torch

    old, new = tensor_summary(path, va, sa), tensor_summary(path, vb, sb)
    if old.shape != new.shape or old.dtype != new.dtype:
        return TensorChange(path, old, new, None, None)
    ta = load_tensor(core, ca, sa, va)
    tb = load_tensor(core, cb, sb, vb)
    if isinstance(ta, np.ndarray):
        ta, tb = torch.from_numpy(np.asarray(ta)), torch.from_numpy(np.asarray(tb))
    if _same_bytes(ta, tb):
        return None
    if not (
        ta.dtype.is_floating_point
        or ta.dtype.is_complex
        or ta.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
    ):
        return TensorChange(path, old, new, None, None)
    xa, xb = (
        ta.detach().to(torch.float64 if not ta.is_complex() else torch.complex128),
        tb.detach().to(torch.float64 if not tb.is_complex() else torch.complex128),
    )
    delta = (xb - xa).abs()
    norm_a = float(torch.linalg.vector_norm(xa)) if xa.numel() else 0.0
    norm_d = float(torch.linalg.vector_norm(delta)) if delta.numel() else 0.0
    rel = norm_d / norm_a if norm_a else (0.0 if norm_d == 0 else math.inf)
    return TensorChange(path, old, new, rel, float(delta.max()) if delta.numel() else 0.0)


def _same_bytes(a: Any, b: Any) -> bool:
    """Two tensors of one dtype and shape hold the same bytes (NaNs by their bits)."""
    import torch

    ca, cb = a.detach().contiguous(), b.detach().contiguous()
    if ca.numel() == 0 or ca.element_size() == 0:
        return True
    return torch.equal(ca.reshape(-1).view(torch.uint8), cb.reshape(-1).view(torch.uint8))


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _display_value(v: Any) -> Any:
    from ckvc.state import TensorInfo

    if isinstance(v, TensorInfo):
        return f"<tensor {list(v.shape)}>"
    return v
