"""Round-trip matrix: states go through a real repository (commit, then load) and
come back bit-exact, with their container types, key order and tensor sharing.

Tensors are compared by their logical bytes (never by value), so NaN payloads,
-0.0 and non-canonical float8/bool patterns all count.
"""

from __future__ import annotations

import collections
import math
import random
import struct
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckvc
from ckvc.state import TORCH_DTYPES

DTYPE_NAMES = sorted(TORCH_DTYPES)


# ---- helpers -------------------------------------------------------------------
def tensor_bytes(t: torch.Tensor) -> bytes:
    """The logical bytes of ``t`` in row-major order, whatever its strides or dtype
    (read through a uint8 view of its storage, so no dtype arithmetic is involved)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.numel() == 0:
        return b""
    k = t.element_size()
    u = torch.empty(0, dtype=torch.uint8).set_(
        t.untyped_storage(),
        t.storage_offset() * k,
        (*t.shape, k),
        (*(s * k for s in t.stride()), 1),
    )
    return bytes(u.contiguous().numpy().tobytes())


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1  # other byte values are not valid bools for torch
    return raw.view(dtype).reshape(shape)


def assert_same(a: Any, b: Any, path: str = "<root>") -> None:
    """Deep, exact equality: same types everywhere, same key order, same bytes."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert a.device == b.device, f"{path}: device"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad"
        assert tensor_bytes(a) == tensor_bytes(b), f"{path}: bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype.str == b.dtype.str, f"{path}: dtype {a.dtype.str} != {b.dtype.str}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), f"{path}: bytes differ"
    elif isinstance(a, np.generic):
        assert a.dtype.str == b.dtype.str, f"{path}: dtype {a.dtype.str} != {b.dtype.str}"
        assert a.tobytes() == b.tobytes(), f"{path}: bytes differ"
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert [(type(k), k) for k in a] == [(type(k), k) for k in b], f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):  # torch.Size included; its type was checked above
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def roundtrip(repo: ckvc.Repo, state: Any, **kwargs: Any) -> Any:
    commit_id = repo.commit(state, message="roundtrip", **kwargs)
    return repo.load(commit_id, allow_pickle=bool(kwargs.get("allow_pickle")))


def storage_ptr(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


def repo_snapshot(repo: ckvc.Repo) -> tuple[Any, ...]:
    """Everything a failed commit must leave untouched."""
    files = sorted(p.name for p in (repo.dir / "packs").iterdir())
    logs = sorted(
        (p.relative_to(repo.dir).as_posix(), p.read_bytes()) for p in (repo.dir / "logs").rglob("*") if p.is_file()
    )
    return repo.head(), repo.branches(), files, repo.store.index.count(), logs


@pytest.fixture
def repo(tmp_path: Path) -> Any:
    # The smallest chunk size, so that moderately sized tensors span several chunks.
    with ckvc.Repo.init(tmp_path / "r", chunk_size=4096) as r:
        yield r


class Custom:
    """A plain user class: not storable without pickle."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is Custom and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


# ---- every dtype ---------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_dtype_matrix(repo: ckvc.Repo, name: str) -> None:
    dtype = TORCH_DTYPES[name]
    seed = DTYPE_NAMES.index(name) * 100
    base = random_tensor(dtype, (4, 6), seed)
    other = random_tensor(dtype, (5, 7), seed + 1)
    expand_src = random_tensor(dtype, (1, 6), seed + 2)
    big = random_tensor(dtype, (1000,), seed + 3)
    large = random_tensor(dtype, (3000,), seed + 4)  # several 4 KiB chunks for every itemsize
    state = {
        "contig": base,
        "scalar": random_tensor(dtype, (), seed + 5),
        "empty": torch.empty((0, 4), dtype=dtype),
        "empty2": torch.empty((3, 0, 2), dtype=dtype),
        "transposed": other.t(),
        "expanded": expand_src.expand(5, 6),
        "view": big[100:130],
        "large": large,
    }
    assert not state["transposed"].is_contiguous()
    assert state["expanded"].stride() == (0, 1)
    out = roundtrip(repo, state)
    assert_same(state, out)
    assert out["scalar"].dim() == 0
    for key in ("contig", "transposed", "large"):
        assert out[key].dtype == dtype


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_dtype_shared_views(repo: ckvc.Repo, name: str) -> None:
    """Views of one storage in every dtype come back as views of one storage."""
    dtype = TORCH_DTYPES[name]
    base = random_tensor(dtype, (4, 6), 7 + DTYPE_NAMES.index(name))
    state = {"w": base, "wt": base.t(), "row": base[1], "col": base[:, 2]}
    out = roundtrip(repo, state)
    assert_same(state, out)
    ptrs = {storage_ptr(out[k]) for k in state}
    assert len(ptrs) == 1
    assert out["wt"].stride() == (1, 6)
    assert out["col"].stride() == (6,)
    assert repo.last_commit_stats is not None
    assert repo.last_commit_stats.logical_bytes == 24 * dtype.itemsize


def test_special_float_bit_patterns(repo: ckvc.Repo) -> None:
    bits32 = [0x80000000, 0x7FC00000, 0xFFC00001, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000001, 0x7FBFFFFF]
    f32 = torch.tensor(bits32, dtype=torch.int64).to(torch.int32).view(torch.float32)
    bits16 = [0x8000, 0x7E01, 0xFC01, 0x7C00, 0x0001, 0xFFFF]
    f16 = torch.tensor(bits16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    bf16 = torch.tensor(bits16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    f8 = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    state = {"f32": f32, "f16": f16, "bf16": bf16}
    for name in DTYPE_NAMES:
        if TORCH_DTYPES[name].itemsize == 1 and name != "bool":
            state[name] = f8.view(TORCH_DTYPES[name])  # all 256 patterns
    out = roundtrip(repo, state)
    assert_same(state, out)
    assert tensor_bytes(out["f32"]) == struct.pack("<8I", *bits32)


def test_conj_and_neg_views_are_resolved(repo: ckvc.Repo) -> None:
    z = random_tensor(torch.complex64, (3, 4), 11)
    c = z.conj()
    assert c.is_conj()
    state = {"conj": c}
    out = roundtrip(repo, state)
    assert not out["conj"].is_conj()
    assert tensor_bytes(out["conj"]) == tensor_bytes(c.resolve_conj())


# ---- views, sharing, tying ----------------------------------------------------
def test_view_of_larger_tensor_stores_only_the_view(repo: ckvc.Repo) -> None:
    big = random_tensor(torch.float32, (100_000,), 1)
    v = big[1000:1100]
    out = roundtrip(repo, {"v": v})
    assert_same({"v": v}, out)
    assert repo.last_commit_stats is not None
    assert repo.last_commit_stats.logical_bytes == 100 * 4
    # A 0-dim element of a large tensor: one element stored.
    out = roundtrip(repo, {"e": big[5]})
    assert out["e"].shape == ()
    assert tensor_bytes(out["e"]) == tensor_bytes(big[5])
    assert repo.last_commit_stats.logical_bytes == 4
    # A zero-size view of a large tensor stores nothing.
    out = roundtrip(repo, {"z": big[10:10]})
    assert out["z"].shape == (0,)
    assert repo.last_commit_stats.logical_bytes == 0


def test_far_apart_views_are_stored_separately(repo: ckvc.Repo) -> None:
    big = random_tensor(torch.float64, (10_000,), 2)
    state = {"a": big[:10], "b": big[-10:]}
    out = roundtrip(repo, state)
    assert_same(state, out)
    assert repo.last_commit_stats is not None
    assert repo.last_commit_stats.logical_bytes == 20 * 8


def test_overlapping_views_share_storage(repo: ckvc.Repo) -> None:
    big = random_tensor(torch.float32, (1000,), 3)
    state = {"a": big[0:100], "b": big[50:150]}
    out = roundtrip(repo, state)
    assert_same(state, out)
    assert storage_ptr(out["a"]) == storage_ptr(out["b"])
    assert out["b"].storage_offset() - out["a"].storage_offset() == 50
    assert repo.last_commit_stats is not None
    assert repo.last_commit_stats.logical_bytes == 150 * 4
    # Writing through one view shows through the other, as before the commit.
    out["b"][0] = 42.0
    assert float(out["a"][50]) == 42.0


def test_tied_tensors(repo: ckvc.Repo) -> None:
    w = random_tensor(torch.float32, (16, 8), 4)
    state = {"a": w, "b": w, "nested": {"c": (w, [w])}}
    out = roundtrip(repo, state)
    assert_same(state, out)
    ptr = storage_ptr(out["a"])
    for t in (out["b"], out["nested"]["c"][0], out["nested"]["c"][1][0]):
        assert storage_ptr(t) == ptr
    assert repo.last_commit_stats is not None
    assert repo.last_commit_stats.logical_bytes == 16 * 8 * 4


def test_expanded_view_shares_with_its_base(repo: ckvc.Repo) -> None:
    x = random_tensor(torch.int16, (1, 5), 5)
    state = {"x": x, "e": x.expand(4, 5)}
    out = roundtrip(repo, state)
    assert_same(state, out)
    assert storage_ptr(out["x"]) == storage_ptr(out["e"])
    assert out["e"].stride() == (0, 1)


def test_tied_weights_in_a_module_state_dict(repo: ckvc.Repo) -> None:
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    sd = model.state_dict()
    assert storage_ptr(sd["emb.weight"]) == storage_ptr(sd["head.weight"])
    out = roundtrip(repo, sd)
    assert_same(sd, out)
    assert type(out) is collections.OrderedDict
    assert storage_ptr(out["emb.weight"]) == storage_ptr(out["head.weight"])


def test_parameters(repo: ckvc.Repo) -> None:
    p = torch.nn.Parameter(random_tensor(torch.float32, (3, 4), 6))
    q = torch.nn.Parameter(random_tensor(torch.float16, (2,), 7), requires_grad=False)
    g = random_tensor(torch.float64, (5,), 8).requires_grad_(True)
    state = {"p": p, "q": q, "p_again": p, "g": g, "nongrad": (g * 2).detach()}
    out = roundtrip(repo, state)
    assert_same(state, out)
    assert type(out["p"]) is torch.nn.Parameter and out["p"].requires_grad
    assert type(out["q"]) is torch.nn.Parameter and not out["q"].requires_grad
    assert type(out["g"]) is torch.Tensor and out["g"].requires_grad and out["g"].is_leaf
    assert storage_ptr(out["p"]) == storage_ptr(out["p_again"])


# ---- training state ------------------------------------------------------------
def _model_and_batch(seed: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x = torch.randn(5, 6)
    y = torch.randn(5, 3)
    return model, x, y


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_optimizer_and_scheduler_state(repo: ckvc.Repo, kind: str) -> None:
    def make(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        if kind == "adamw":
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, nesterov=True)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
        return opt, sched

    model, x, y = _model_and_batch(0)
    opt, sched = make(model)
    for _ in range(2):
        _train_step(model, opt, x, y)
        sched.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "epoch": 2}
    assert state["optimizer"]["state"], "the optimizer has per-parameter state after a step"
    out = roundtrip(repo, state)
    assert_same(state, out)

    # The restored state resumes training exactly like the original.
    model2, _, _ = _model_and_batch(1)
    opt2, sched2 = make(model2)
    model2.load_state_dict(out["model"])
    opt2.load_state_dict(out["optimizer"])
    sched2.load_state_dict(out["scheduler"])
    for _ in range(2):
        _train_step(model, opt, x, y)
        sched.step()
        _train_step(model2, opt2, x, y)
        sched2.step()
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), model2.state_dict().items(), strict=True):
        assert n1 == n2
        assert tensor_bytes(p1) == tensor_bytes(p2), n1
    assert sched.get_last_lr() == sched2.get_last_lr()


def test_grad_scaler_state(repo: ckvc.Repo) -> None:
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        model, x, y = _model_and_batch(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
        sd = scaler.state_dict()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        pytest.skip(f"GradScaler on the CPU does not work here: {exc}")
    assert sd, "an enabled scaler has state"
    out = roundtrip(repo, {"scaler": sd})
    assert_same({"scaler": sd}, out)
    scaler2 = torch.amp.GradScaler("cpu")
    scaler2.load_state_dict(out["scaler"])
    assert scaler2.get_scale() == scaler.get_scale()


def test_rng_state_roundtrip(repo: ckvc.Repo) -> None:
    random.seed(123)
    np.random.seed(456)
    torch.manual_seed(789)
    random.random()
    state = {"rng": ckvc.rng_state(), "step": 3}
    commit_id = repo.commit(state)

    def draw() -> tuple[list[float], bytes, bytes]:
        return (
            [random.random() for _ in range(5)],
            np.random.standard_normal(5).tobytes(),
            tensor_bytes(torch.randn(5)),
        )

    first = draw()
    draw()  # move every generator further on
    loaded = repo.load(commit_id)
    assert_same(state, loaded)
    ckvc.set_rng_state(loaded["rng"])
    assert draw() == first


# ---- plain values --------------------------------------------------------------
def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<Q", bits))[0])


def test_plain_values(repo: ckvc.Repo) -> None:
    state: dict[str, Any] = {
        "none": None,
        "true": True,
        "false": False,
        "ints": [0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 2**100, -(2**70), 10**40],
        "floats": [
            0.0,
            -0.0,
            math.inf,
            -math.inf,
            math.nan,
            _float(0x7FF0000000000001),  # signalling NaN
            _float(0xFFF8DEADBEEF0001),  # negative NaN with a payload
            5e-324,
            1.7976931348623157e308,
            0.1,
        ],
        "str": ["", "héllo", "日本語", "\x00nul", "emoji 🎉"],
        "bytes": [b"", b"\x00\xff" * 100, bytes(range(256))],
        "tuple": (1, "a", (2,), ()),
        "list": [1, "a", [2], []],
        "empty_tuple": (),
        "empty_list": [],
        "empty_dict": {},
        "dtypes": [getattr(torch, n) for n in DTYPE_NAMES],
        "size": torch.Size([3, 0, 5]),
        "empty_size": torch.Size([]),
        "devices": [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")],
    }
    out = roundtrip(repo, state)
    assert_same(state, out)
    assert type(out["tuple"]) is tuple and type(out["list"]) is list
    assert type(out["tuple"][2]) is tuple and type(out["list"][2]) is list


def test_dict_key_types_and_order(repo: ckvc.Repo) -> None:
    state = {"b": 1, 3: 2, "a": 3, 1: 4, "1": 5, -7: 6, 2**64 - 1: 7, -(2**63): 8, "": 9, 0: 10}
    ordered = collections.OrderedDict([("z", 1), ("y", {2: "x", 1: "w"}), (5, [collections.OrderedDict()])])
    out = roundtrip(repo, {"d": state, "od": ordered, "plain": dict(ordered)})
    assert_same({"d": state, "od": ordered, "plain": dict(ordered)}, out)
    assert type(out["od"]) is collections.OrderedDict
    assert type(out["od"][5][0]) is collections.OrderedDict
    assert type(out["plain"]) is dict
    assert list(out["d"]) == list(state)


def test_tuple_and_list_stay_distinct(repo: ckvc.Repo) -> None:
    state: list[Any] = [(1, 2), [1, 2], ([(), []],), [[(1,)]]]
    out = roundtrip(repo, {"x": state})
    assert_same({"x": state}, out)


def test_numpy_arrays_and_scalars(repo: ckvc.Repo) -> None:
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, 4096, dtype=np.uint8)
    arrays = {
        "f4": raw[:64].view("<f4").reshape(4, 4),
        "f4_big_endian": raw[:64].view(">f4"),
        "f8": raw[:80].view("<f8"),
        "f2": raw[:20].view("<f2"),
        "i8_big_endian": raw[:80].view(">i8"),
        "u2": raw[:20].view("<u2"),
        "c16": raw[:64].view("<c16"),
        "bool": (raw[:10] & 1).astype(bool),
        "fortran": np.asfortranarray(raw[:30].view("<i2").reshape(3, 5)),
        "strided": raw[:64].view("<f4")[::3],
        "empty": np.zeros((0, 3), dtype=np.float32),
        "unicode": np.array(["ab", "", "日本"]),
        "bytes": np.array([b"ab", b"\x00c"]),
        "datetime": np.array([0, 10**18], dtype="M8[ns]"),
        "timedelta": np.array([5, -5], dtype="m8[s]"),
        # an odd itemsize over several chunks: chunk boundaries fall on elements
        "odd_itemsize": np.array([f"{i:03d}" for i in range(1000)]),
    }
    scalars = {
        "f4": np.float32(-0.0),
        "f8": np.float64(_float(0xFFF8DEADBEEF0001)),
        "f2": np.float16("nan"),
        "i8": np.int64(-(2**63)),
        "u8": np.uint64(2**64 - 1),
        "bool": np.bool_(True),
        "c8": np.complex64(1 - 2j),
        "str": np.str_("abc"),
        "bytes": np.bytes_(b"xy"),
        "datetime": np.datetime64("2020-01-01"),
        "timedelta": np.timedelta64(5, "s"),
    }
    state = {"arrays": arrays, "scalars": scalars}
    out = roundtrip(repo, state)
    assert_same(state, out)
    assert out["arrays"]["f4_big_endian"].dtype.str == ">f4"
    assert out["arrays"]["fortran"].tolist() == arrays["fortran"].tolist()


def test_numpy_zero_dim_array(repo: ckvc.Repo) -> None:
    state = {"a": np.array(3.5, dtype=">f4"), "b": np.array(7, dtype=np.int64)}
    out = roundtrip(repo, state)
    assert_same(state, out)  # shape () != (1,)


# ---- unsupported values --------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "path"),
    [
        ({"optimizer": {"state": {3: {"foo": Custom(1)}}}}, "optimizer.state.3.foo"),
        ({"model": {"act": lambda x: x}}, "model.act"),
        ({"a": [1, 2, {3, 4}]}, "a.2"),
        ({"a": (0, {"b": frozenset()})}, "a.1.b"),
        ({"cfg": {(1, 2): 3}}, "cfg"),
        ({"cfg": {"k": {2**70: 1}}}, "cfg.k"),
        ({"cfg": {-(2**63) - 1: 1}}, "cfg"),
        ({"cfg": {b"k": 1}}, "cfg"),
        ({"cfg": {True: 1}}, "cfg"),
        ({"names": ["ok", "\ud800"]}, "names.1"),
        ({"cfg": {"\udc00": 1}}, "cfg"),
        ({"t": torch.zeros(2).to_sparse()}, "t"),
        ({"meta": {"w": torch.zeros(2, device="meta")}}, "meta.w"),
        ({"d": torch.qint8}, "d"),
        ({"n": np.array([object()], dtype=object)}, "n"),
        ({"m": np.ma.masked_array([1, 2])}, "m"),
    ],
    ids=[
        "custom",
        "lambda",
        "set",
        "frozenset",
        "tuple-key",
        "bigint-key",
        "negbigint-key",
        "bytes-key",
        "bool-key",
        "lone-surrogate",
        "surrogate-key",
        "sparse",
        "meta",
        "qdtype",
        "npobject",
        "npsub",
    ],
)
def test_unsupported_values_name_their_path(repo: ckvc.Repo, state: Any, path: str) -> None:
    first = repo.commit({"ok": torch.ones(3)}, message="before")
    before = repo_snapshot(repo)
    with pytest.raises(ckvc.UnsupportedTypeError) as info:
        repo.commit(state, message="bad")
    assert f"cannot store value at {path}:" in str(info.value)
    assert info.value.path == path
    assert isinstance(info.value, TypeError)
    assert repo_snapshot(repo) == before
    assert repo.head() == ("main", first)
    assert list(repo.load().keys()) == ["ok"]


def test_pickle_warning_points_at_the_caller(repo: ckvc.Repo) -> None:
    with pytest.warns(UserWarning, match="pickling") as record:
        repo.commit({"a": {"b": [{1, 2}]}}, allow_pickle=True)
    assert record[0].filename == __file__


def test_unencodable_keys_and_strings_pickle_when_allowed(repo: ckvc.Repo) -> None:
    """Out-of-range int keys and lone surrogates are refused (see the table above),
    and stored through pickle when that is allowed."""
    state = {"d": {2**70: 1}, "s": ["ok", "\ud800"]}
    with pytest.warns(UserWarning, match="pickling"):
        out = roundtrip(repo, state, allow_pickle=True)
    assert out == state


def test_exception_mid_commit_leaves_repo_unchanged(repo: ckvc.Repo) -> None:
    first = repo.commit({"x": torch.zeros(10)})
    before = repo_snapshot(repo)

    def progress(done: int, total: int) -> None:
        if done > 3 * 4096:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        repo.commit({"big": random_tensor(torch.float32, (20_000,), 9)}, progress=progress)
    assert repo_snapshot(repo) == before
    assert repo.head() == ("main", first)
    report = repo.fsck()
    assert report.ok, report.problems


# ---- pickle opt-in -------------------------------------------------------------
def test_allow_pickle(repo: ckvc.Repo) -> None:
    state = {"s": {1, 2, 3}, "obj": Custom(7), "t": torch.arange(4)}
    before = repo_snapshot(repo)
    with pytest.raises(ckvc.UnsupportedTypeError):
        repo.commit(state)
    assert repo_snapshot(repo) == before
    with pytest.warns(UserWarning) as record:
        commit_id = repo.commit(state, allow_pickle=True)
    messages = sorted(str(w.message) for w in record)
    assert len(messages) == 2
    assert messages[0].startswith("ckvc: pickling the value at obj (")
    assert messages[1].startswith("ckvc: pickling the value at s (")
    assert repo.read_commit(commit_id).pickled
    with pytest.raises(ckvc.UnsafeContentError):
        repo.load(commit_id)
    with pytest.raises(ckvc.UnsafeContentError):
        repo.checkout(commit_id)
    assert repo.head() == ("main", commit_id)  # checkout refused before moving anything
    out = repo.load(commit_id, allow_pickle=True)
    assert out["s"] == {1, 2, 3} and type(out["s"]) is set
    assert out["obj"] == Custom(7)
    assert_same(state["t"], out["t"])
    # A commit without pickled values loads without the opt-in, and warns nothing.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = repo.commit({"t": torch.arange(4)})
        repo.load(plain)


# ---- property test -------------------------------------------------------------
_PROP_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.complex64, torch.bool]


@st.composite
def small_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_PROP_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    data = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize, max_size=math.prod(shape) * dtype.itemsize))
    raw = torch.tensor(list(data), dtype=torch.uint8)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**90), max_value=2**90),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=10),
    st.binary(max_size=16),
    small_tensors(),
)
_keys = st.one_of(st.text(max_size=6), st.integers(min_value=-(2**63), max_value=2**64 - 1))
_states = st.recursive(
    _leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_keys, children, max_size=4),
    ),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def shared_repo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with ckvc.Repo.init(tmp_path_factory.mktemp("prop") / "r") as r:
        yield r


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state=_states)
def test_random_nested_states_roundtrip(shared_repo: ckvc.Repo, state: Any) -> None:
    out = roundtrip(shared_repo, {"s": state})
    assert_same({"s": state}, out)
