"""ckvc.numpy (commits read as NumPy arrays, no torch imported) and ckvc.jax (JAX
pytrees committed in torch's format and loaded back, PyTorch commits loaded into
Flax), issue 29."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckvc
import ckvc.numpy as ckvc_numpy
from ckvc.errors import IncompatibleStateError, InvalidInputError, UnsupportedTypeError
from ckvc.state.tables import DTYPE_FACTS, TORCH_DTYPES

ROOT = Path(__file__).resolve().parents[1]
NO_NUMPY_MATCH = ("complex32", "float4_e2m1fn_x2")


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes() if t.element_size() else b""


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    dtype = TORCH_DTYPES[name]
    if name == "bool":
        return torch.randint(0, 2, shape, generator=gen).bool()
    n = int(np.prod(shape)) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype.is_floating_point and dtype.itemsize > 1:
        raw = torch.randn(int(np.prod(shape)), generator=gen).to(dtype).view(torch.uint8)
    return raw.view(dtype).reshape(shape)


def test_dtype_facts_are_torchs() -> None:
    """The written-out table the torch-free parser uses says what torch says."""
    for name, (itemsize, grad) in DTYPE_FACTS.items():
        if name not in TORCH_DTYPES:  # an older torch: its blobs are refused as unknown when read
            continue
        dtype = TORCH_DTYPES[name]
        assert (itemsize, grad) == (dtype.itemsize, dtype.is_floating_point or dtype.is_complex), name


def test_every_torch_dtype_reads_as_the_same_bytes_in_numpy(tmp_path: Path) -> None:
    pytest.importorskip("ml_dtypes", reason="bfloat16/float8 arrays need ml_dtypes: pip install 'ckvc[jax]'")
    gen = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {name: _random(name, (3, 5), gen) for name in DTYPE_FACTS if name not in NO_NUMPY_MATCH}
    base = torch.arange(30, dtype=torch.float32).reshape(5, 6)
    state["views"] = {"t": base.t(), "cols": base[:, 1:4], "step": base[::2, ::3], "base": base}
    state["empty"] = torch.empty(0, 4, dtype=torch.bfloat16)
    with ckvc.Repo.init(tmp_path / "r") as repo:
        repo.commit(state, message="dtypes")
        loaded = ckvc_numpy.load(repo)
        for name in state.keys() - {"views", "empty"}:
            array = loaded[name]
            assert isinstance(array, np.ndarray) and array.dtype.name == name and array.shape == (3, 5), name
            assert array.tobytes() == _bytes(state[name]), name
        for key, view in state["views"].items():
            array = loaded["views"][key]
            assert array.shape == tuple(view.shape)
            assert np.array_equal(array, view.numpy())
        # the views share one buffer, as the tensors shared one storage
        assert np.shares_memory(loaded["views"]["t"], loaded["views"]["base"])
        assert loaded["empty"].shape == (0, 4) and loaded["empty"].dtype.name == "bfloat16"
        # keys/prefix read as Repo.load's do
        flat = ckvc_numpy.load(repo, keys=["bfloat16"], prefix="views.")
        assert sorted(flat) == ["bfloat16", "views.base", "views.cols", "views.step", "views.t"]
        with pytest.raises(ckvc.UnknownKeyError):
            ckvc_numpy.load(repo, keys=["nothing"])
        # a torch.Size is one leaf, as for Repo.load
        repo.commit({"cfg": {"size": torch.Size([2, 3]), "dtype": torch.bfloat16}}, message="cfg")
        assert ckvc_numpy.load(repo, prefix="cfg.") == {"cfg.size": (2, 3), "cfg.dtype": "bfloat16"}
        assert list(repo.load(prefix="cfg.")) == ["cfg.size", "cfg.dtype"]


@pytest.mark.parametrize("name", NO_NUMPY_MATCH)
def test_a_dtype_numpy_cannot_hold_is_a_typed_error(tmp_path: Path, name: str) -> None:
    with ckvc.Repo.init(tmp_path / "r") as repo:
        repo.commit({"x": torch.zeros(4, dtype=torch.uint8).view(TORCH_DTYPES[name]), "y": torch.ones(2)})
        with pytest.raises(InvalidInputError, match=name):
            ckvc_numpy.load(repo)
        assert ckvc_numpy.load(repo, keys=["y"])["y"].tolist() == [1.0, 1.0]


def test_numpy_load_imports_no_torch(tmp_path: Path) -> None:
    """In a fresh interpreter: the arrays' bytes equal the committed tensors', torch
    never imported; without ml_dtypes a bfloat16 tensor is a typed error and the
    rest still reads."""
    pytest.importorskip("ml_dtypes", reason="bfloat16 arrays need ml_dtypes: pip install 'ckvc[jax]'")
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(6, 4, generator=gen)
    state: dict[str, Any] = {
        "model": {"weight": weight, "bias": torch.randn(6, generator=gen), "wt": weight.t()},
        "bf16": torch.randn(7, generator=gen).to(torch.bfloat16),
        "np": np.arange(6, dtype=np.int16),
        "step": 12,
        "size": torch.Size([2, 3]),
        "dtype": torch.float16,
    }
    with ckvc.Repo.init(tmp_path / "r") as repo:
        repo.commit(state, message="for numpy")
    code = textwrap.dedent(
        f"""
        import hashlib, json, sys
        import ckvc.numpy
        from ckvc.errors import InvalidInputError
        state = ckvc.numpy.load({str(tmp_path / "r")!r})
        arrays = {{k: v for k, v in state["model"].items()}} | {{"bf16": state["bf16"], "np": state["np"]}}
        out = {{k: [v.dtype.name, list(v.shape), hashlib.sha256(v.tobytes()).hexdigest()] for k, v in arrays.items()}}
        out["plain"] = [state["step"], list(state["size"]), state["dtype"]]
        out["torch"] = "torch" in sys.modules
        sys.modules["ml_dtypes"] = None
        ckvc.state.numpy_dtype.cache_clear()
        try:
            ckvc.numpy.load({str(tmp_path / "r")!r}, keys=["bf16"])
        except InvalidInputError as exc:
            out["no_ml_dtypes"] = str(exc)
        bias = ckvc.numpy.load({str(tmp_path / "r")!r}, keys=["model.bias"])["model.bias"]
        out["f32_without_ml_dtypes"] = bias.dtype.name
        out["torch_after"] = "torch" in sys.modules
        print(json.dumps(out))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["torch"] is False and out["torch_after"] is False
    expected = {
        "weight": weight, "bias": state["model"]["bias"], "wt": weight.t(), "bf16": state["bf16"],
    }  # fmt: skip
    for key, tensor in expected.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        assert out[key] == [dtype, list(tensor.shape), hashlib.sha256(_bytes(tensor)).hexdigest()], key
    assert out["np"] == ["int16", [6], hashlib.sha256(state["np"].tobytes()).hexdigest()]
    assert out["plain"] == [12, [2, 3], "float16"]
    assert "ml_dtypes" in out["no_ml_dtypes"]  # the typed error, no crash
    assert out["f32_without_ml_dtypes"] == "float32"


# ---- JAX ------------------------------------------------------------------------

JAX_DTYPES = (
    "bool", "int8", "int16", "int32", "uint8", "uint16", "uint32", "float16", "float32", "bfloat16",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "complex64",
)  # fmt: skip


@pytest.fixture
def jax_mod():  # type: ignore[no-untyped-def]
    return pytest.importorskip("jax", reason="ckvc.jax needs the jax extra: pip install 'ckvc[jax]'")


def _jax_tree(jax) -> dict:  # type: ignore[no-untyped-def]
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    leaves = {}
    for i, name in enumerate(JAX_DTYPES):
        raw = jax.random.bits(jax.random.fold_in(key, i), (2, 3), dtype=jnp.uint8)
        if name == "bool":
            leaves[name] = raw > 127
        elif name.startswith(("float", "bfloat")) or name == "complex64":
            leaves[name] = jax.random.normal(jax.random.fold_in(key, i), (2, 3)).astype(name)
        else:
            leaves[name] = raw.astype(name)
    return {
        "params": leaves,
        "opt": [jnp.arange(4, dtype=jnp.int32), (jnp.ones((), dtype=jnp.float32), np.float32(2.5))],
        "host": np.arange(3, dtype=np.int64),
        "step": 7,
        "name": "run",
    }


def test_a_jax_pytree_loads_in_pytorch_bit_exact_and_back(tmp_path: Path, jax_mod) -> None:  # type: ignore[no-untyped-def]
    import ckvc.jax

    jax = jax_mod
    tree = _jax_tree(jax)
    with ckvc.Repo.init(tmp_path / "r") as repo:
        ckvc.jax.commit(repo, tree, message="from jax", metrics={"loss": 0.5})
        state = repo.load()
        for name in JAX_DTYPES:
            tensor = state["params"][name]
            assert isinstance(tensor, torch.Tensor) and str(tensor.dtype) == f"torch.{name}", name
            assert _bytes(tensor) == np.asarray(tree["params"][name]).tobytes(), name
        assert state["opt"][0].tolist() == [0, 1, 2, 3] and isinstance(state["opt"][1], tuple)
        assert state["opt"][1][1] == np.float32(2.5) and state["step"] == 7 and state["name"] == "run"
        assert np.array_equal(state["host"], tree["host"])
        # back into JAX, shaped after the tree itself
        back = ckvc.jax.load(repo, like=tree)
        assert back.keys() == tree.keys() and isinstance(back["opt"][1], tuple)
        for name in JAX_DTYPES:
            array = back["params"][name]
            assert isinstance(array, jax.Array) and array.dtype == tree["params"][name].dtype, name
            assert np.asarray(array).tobytes() == np.asarray(tree["params"][name]).tobytes(), name
        assert back["step"] == 7 and back["name"] == "run"
        # without like: the whole state, every array a jax.Array
        whole = ckvc.jax.load(repo)
        assert isinstance(whole["params"]["bfloat16"], jax.Array) and whole["step"] == 7


def test_like_checks_shapes_and_dtypes(tmp_path: Path, jax_mod) -> None:  # type: ignore[no-untyped-def]
    import jax.numpy as jnp

    import ckvc.jax

    jax = jax_mod
    with ckvc.Repo.init(tmp_path / "r") as repo:
        ckvc.jax.commit(repo, {"w": jnp.ones((2, 3), dtype=jnp.bfloat16), "b": jnp.zeros(3)})
        abstract = {"w": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16), "b": jax.ShapeDtypeStruct((3,), jnp.float32)}
        got = ckvc.jax.load(repo, like=abstract)
        assert got["w"].dtype == jnp.bfloat16 and got["b"].shape == (3,)
        with pytest.raises(IncompatibleStateError, match=r"w: shape \(2, 3\) in the commit, \(3, 2\) expected"):
            ckvc.jax.load(repo, like={"w": jax.ShapeDtypeStruct((3, 2), jnp.bfloat16)})
        wrong_dtype = {"b": jax.ShapeDtypeStruct((3,), jnp.float16)}
        with pytest.raises(IncompatibleStateError, match="dtype float32 in the commit, float16 expected"):
            ckvc.jax.load(repo, like=wrong_dtype)
        assert ckvc.jax.load(repo, like=wrong_dtype, strict=False)["b"].dtype == jnp.float16
        with pytest.raises(ckvc.UnknownKeyError):
            ckvc.jax.load(repo, like={"missing": jax.ShapeDtypeStruct((1,), jnp.float32)})


def test_a_dtype_torch_lacks_is_refused_and_nothing_is_committed(tmp_path: Path, jax_mod) -> None:  # type: ignore[no-untyped-def]
    import jax.numpy as jnp

    import ckvc.jax

    with ckvc.Repo.init(tmp_path / "r") as repo:
        ckvc.jax.commit(repo, {"w": jnp.ones(2)}, message="first")
        head = repo.resolve("HEAD")
        with pytest.raises(UnsupportedTypeError, match=r"params\.q.*int4 has no torch dtype"):
            ckvc.jax.commit(repo, {"params": {"q": jnp.ones(4, dtype=jnp.int4)}}, message="int4")
        assert repo.resolve("HEAD") == head


def test_pytorch_mlp_weights_run_in_flax_with_the_same_outputs(tmp_path: Path, jax_mod) -> None:  # type: ignore[no-untyped-def]
    nn = pytest.importorskip("flax.linen", reason="the Flax model needs flax: pip install 'ckvc[jax]'")
    import jax.numpy as jnp

    import ckvc.jax

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    with ckvc.Repo.init(tmp_path / "r") as repo:
        repo.commit({"model": mlp.state_dict()}, message="torch MLP")
        w = ckvc.jax.load(repo, prefix="model.")

    class MLP(nn.Module):  # type: ignore[name-defined]
        @nn.compact
        def __call__(self, x):  # type: ignore[no-untyped-def]
            hidden = jnp.tanh(nn.Dense(16)(x))  # Dense_0: named in the order they are made
            return nn.Dense(4)(hidden)

    params = {
        "params": {
            "Dense_0": {"kernel": w["model.0.weight"].T, "bias": w["model.0.bias"]},
            "Dense_1": {"kernel": w["model.2.weight"].T, "bias": w["model.2.bias"]},
        }
    }
    x = torch.randn(5, 8)
    expected = mlp(x).detach().numpy()
    got = np.asarray(MLP().apply(params, jnp.asarray(x.numpy())))
    assert np.max(np.abs(got - expected)) <= 1e-6
