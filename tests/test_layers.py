"""The package's import structure, read from the source with ast (nothing is imported):
the layer order of ARCHITECTURE §2 (docs/DESIGN.md, "Layers"), no private names
across modules, no import cycles; and the modules that must import without torch.

Rules, as the checker applies them:
- Every import counts: module level, inside functions (lazy), and under
  ``if TYPE_CHECKING:``. A type-only import of a higher layer is still a dependency
  of the design (fsck naming ``Repo`` is the circle issue 14 removes), so it is held
  to the same order; nothing is exempt by the way it is imported.
- A module may import modules of its own layer and of layers listed before it.
  ``from ckvc.a import b`` is an import of ``ckvc.a.b`` when that is a module, else
  of ``ckvc.a``; importing a module does not count as importing its parent packages.
- Private names: ``from ckvc.a import _x``, ``import ckvc._a``, ``mod._x`` where
  ``mod`` names another ckvc module, and ``obj._x`` where ``_x`` is defined in
  another ckvc module and nowhere in this one (``repo._submit`` from view.py).
  Dunder names are public. The compiled extension ``ckvc._native`` is private to the
  package by name only; its functions are its interface (EXTENSION_MODULES).
- Cycles: strongly connected components of the module graph (every edge above).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ckvc"

# ARCHITECTURE §2, top (imported by everything) to bottom (imports anything above).
# A name covers the module and everything under it (``storage`` covers ckvc.storage.*).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "ids", "_native", "bulk"),
    ("objects", "chunking", "retention_policy"),
    ("codecs",),
    ("state",),
    ("trees",),  # value trees assembled from parts (distributed commits, DCP saves)
    ("storage",),
    ("refs", "pruned", "config", "journal", "runs"),
    ("executor",),
    ("core",),
    ("sidecars",),  # write-once records beside objects (signatures, notes), carried by push and fetch
    ("signing", "notes"),  # signatures and trust: the read paths' check (graph) and the commit's signer (write)
    ("graph",),
    ("write",),
    ("read",),
    ("view", "inspect", "stats"),
    ("fsck", "gc", "retention", "manifest", "hooks", "scrub"),
    ("hybrid.settings",),  # hybrid.json: a lazy clone's fetch reads it
    ("remote",),
    ("hybrid",),  # the hybrid cache: promisor, budget, auto_push, status, in front of the remotes
    ("formats",),
    # load_into (the facade's Repo.load_into) works on the core alone, below the
    # facade; the framework integrations (dcp, lightning, ...) take a Repo.
    ("restore", "committer", "validate"),  # Repo.load_into and Repo.commit, below the facade
    ("repo",),
    ("metrics",),  # ckvc stats and /metrics: over the facade's reports
    ("distributed",),  # multi-rank commits over a Repo; the DCP integration builds on it
    ("numpy",),  # a commit as NumPy arrays, without torch; ckvc.jax builds on it
    ("integrations", "importer", "dcp", "jax"),
    ("web",),  # `ckvc serve`: over Repo and the to_json() results
    ("cli", "__main__"),
    ("",),  # the package root: exports lazily from everything
)
EXTENSION_MODULES = frozenset({"ckvc._native"})

# Modules that must import without torch (a sync daemon, the web server and the
# metadata-only CLI commands start fast). Everything under ckvc/storage/ is added by
# discovery.
TORCH_FREE: tuple[str, ...] = (
    "ckvc.refs", "ckvc.pruned", "ckvc.config", "ckvc.codecs", "ckvc.objects", "ckvc.ids", "ckvc.executor",
    "ckvc.core", "ckvc.graph", "ckvc.retention_policy", "ckvc.web", "ckvc.web.routes", "ckvc.web.server",
    # the NumPy and JAX readers: the parser, the read engine and the arrays made from blobs
    "ckvc.state", "ckvc.state.parse", "ckvc.state.arrays", "ckvc.state.tables", "ckvc.read", "ckvc.numpy", "ckvc.jax",
)  # fmt: skip


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int


def discover(root: Path, package: str) -> dict[str, Path]:
    """Module name -> source file for every .py under ``root`` (packages by __init__)."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join([package, *parts])] = path
    return modules


def module_exists(name: str, modules: dict[str, Path], root: Path, package: str) -> bool:
    """A source module, or a compiled extension known by its stub (``_native.pyi``)."""
    if name in modules:
        return True
    rel = name.split(".")[1:]
    return bool(rel) and root.joinpath(*rel).with_suffix(".pyi").exists()


class _Reader(ast.NodeVisitor):
    """Collects one module's imports, module aliases and private attribute uses."""

    def __init__(self, name: str, is_package: bool, modules: dict[str, Path], root: Path, package: str) -> None:
        self.name, self.is_package = name, is_package
        self.modules, self.root, self.package = modules, root, package
        self.edges: list[Edge] = []
        self.private: list[tuple[str, int]] = []  # (what, line)
        self.aliases: dict[str, str] = {}  # local name -> ckvc module it is bound to
        self.attrs: list[tuple[str, str, int]] = []  # (base expression's alias or "", attr, line)
        self.defined: set[str] = set()  # private names this module defines or assigns
        self.foreign: set[str] = set()  # local names bound to modules outside the package

    def _resolve(self, node: ast.ImportFrom) -> str | None:
        if node.level == 0:
            return node.module
        base = self.name.split(".") if self.is_package else self.name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def _ours(self, name: str | None) -> bool:
        return name is not None and (name == self.package or name.startswith(self.package + "."))

    def _is_module(self, name: str) -> bool:
        return module_exists(name, self.modules, self.root, self.package)

    def _note_private(self, module: str, line: int) -> None:
        if module not in EXTENSION_MODULES and any(
            p.startswith("_") and not p.startswith("__") for p in module.split(".")
        ):
            self.private.append((f"imports private module {module}", line))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if not self._ours(alias.name):
                self.foreign.add(alias.asname or alias.name.split(".")[0])
            else:
                self.edges.append(Edge(self.name, alias.name, node.lineno))
                self._note_private(alias.name, node.lineno)
                if alias.asname:
                    self.aliases[alias.asname] = alias.name
                else:
                    self.aliases.setdefault(alias.name.split(".")[0], self.package)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        source = self._resolve(node)
        if not self._ours(source):
            self.foreign.update(alias.asname or alias.name for alias in node.names)
            return
        assert source is not None
        for alias in node.names:
            full = f"{source}.{alias.name}"
            if self._is_module(full):
                self.edges.append(Edge(self.name, full, node.lineno))
                self._note_private(full, node.lineno)
                self.aliases[alias.asname or alias.name] = full
            else:
                self.edges.append(Edge(self.name, source, node.lineno))
                self._note_private(source, node.lineno)
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    self.private.append((f"imports {source}.{alias.name}", node.lineno))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.ctx, ast.Store):
                self.defined.add(node.attr)
            else:
                base = node.value
                chain: list[str] = []
                while isinstance(base, ast.Attribute):
                    chain.insert(0, base.attr)
                    base = base.value
                if isinstance(base, ast.Name):
                    self.attrs.append((".".join([base.id, *chain]), node.attr, node.lineno))
        self.generic_visit(node)

    def _define(self, name: str) -> None:
        if name.startswith("_"):
            self.defined.add(name)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._define(node.name)
        for arg in [*node.args.args, *node.args.kwonlyargs, *node.args.posonlyargs]:
            self._define(arg.arg)
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._define(node.name)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        # np_core = getattr(np, "_core", None) or np.core: an alias of a foreign module
        if self._foreign_alias(node.value):
            self.foreign.update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.generic_visit(node)

    def _foreign_alias(self, expr: ast.expr) -> bool:
        if isinstance(expr, ast.Name):
            return expr.id in self.foreign
        if isinstance(expr, ast.Attribute):
            return self._foreign_alias(expr.value)
        if isinstance(expr, ast.BoolOp):
            return all(self._foreign_alias(v) or isinstance(v, ast.Constant) for v in expr.values)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "getattr":
            return self._foreign_alias(expr.args[0])
        return False

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Store):
            self._define(node.id)

    def visit_keyword(self, node: ast.keyword) -> None:
        if node.arg:  # dataclasses.replace(x, _field=...) names a field of its own
            self._define(node.arg)
        self.generic_visit(node)


@dataclass
class Structure:
    edges: list[Edge]
    private: list[tuple[str, str, int]]  # (finding, module, line)


def read_package(root: Path, package: str) -> Structure:
    modules = discover(root, package)
    readers = []
    for name, path in modules.items():
        reader = _Reader(name, path.name == "__init__.py", modules, root, package)
        reader.visit(ast.parse(path.read_text(), str(path)))
        readers.append(reader)
    private_defs: dict[str, set[str]] = {}  # private name -> modules defining it
    for reader in readers:
        for attr in reader.defined:
            private_defs.setdefault(attr, set()).add(reader.name)
    private: list[tuple[str, str, int]] = []
    for reader in readers:
        private += [(f"private: {reader.name} {what}", reader.name, line) for what, line in reader.private]
        for base, attr, line in reader.attrs:
            head = base.split(".")[0]
            bound = reader.aliases.get(head)
            if bound is not None:  # mod._x / ckvc.a._x: the chain names a module
                target = ".".join([bound, *base.split(".")[1:]])
                if module_exists(target, modules, root, package):
                    if target != reader.name and target not in EXTENSION_MODULES:
                        private.append((f"private: {reader.name} uses {target}.{attr}", reader.name, line))
                    continue
            owners = private_defs.get(attr, set()) - {reader.name}
            if owners and attr not in reader.defined and head not in ("self", "cls", *reader.foreign):
                finding = f"private: {reader.name} uses {base}.{attr} ({', '.join(sorted(owners))} defines it)"
                private.append((finding, reader.name, line))
    return Structure([e for r in readers for e in r.edges], private)


def layer_of(module: str, package: str, layers: Sequence[Sequence[str]]) -> int | None:
    """The index of the layer whose entry is the longest prefix of ``module``."""
    rel = module[len(package) + 1 :] if module != package else ""
    best: tuple[int, int] | None = None
    for index, names in enumerate(layers):
        for name in names:
            covers = rel == name or (name and rel.startswith(name + "."))
            if covers and (best is None or len(name) > best[1]):
                best = (index, len(name))
    return None if best is None else best[0]


def cycles(edges: Iterable[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.source != e.target:
            graph.setdefault(e.source, set()).add(e.target)
            graph.setdefault(e.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def violations(root: Path, package: str, layers: Sequence[Sequence[str]]) -> dict[str, set[str]]:
    """Every breach of the rules in this file's docstring, one line each, with
    where it happens (``module:line``; a cycle's edges)."""
    structure = read_package(root, package)
    found: dict[str, set[str]] = {}
    for finding, module, line in structure.private:
        found.setdefault(finding, set()).add(f"{module}:{line}")
    for module in discover(root, package):
        if layer_of(module, package, layers) is None:
            found[f"unplaced: {module} is in no layer (add it to LAYERS)"] = set()
    for e in structure.edges:
        source, target = layer_of(e.source, package, layers), layer_of(e.target, package, layers)
        if source is not None and target is not None and target > source:
            found.setdefault(f"layer: {e.source} -> {e.target}", set()).add(f"{e.source}:{e.line}")
    for component in cycles(structure.edges):
        members = set(component)
        found["cycle: " + " <-> ".join(component)] = {
            f"{e.source}:{e.line} -> {e.target}"
            for e in structure.edges
            if e.source != e.target and {e.source, e.target} <= members
        }
    return found


def report(found: dict[str, set[str]], names: Iterable[str]) -> str:
    return "\n".join(f"{name}\n    at {', '.join(sorted(found.get(name, ())))}" for name in sorted(names))


# ---- the real package ---------------------------------------------------------------


def test_ckvc_keeps_its_layers() -> None:
    found = violations(ROOT, "ckvc", LAYERS)
    assert not found, report(found, found)


def torch_free_modules() -> list[str]:
    return sorted({*TORCH_FREE, *(m for m in discover(ROOT, "ckvc") if m.startswith("ckvc.storage"))})


# Reading metadata (log, status, branch, du) needs no codec: these load neither
# numpy nor a codec module (the CLI's history commands gain about 0.3 s).
NUMPY_FREE: tuple[str, ...] = (
    "ckvc.core", "ckvc.graph", "ckvc.repo", "ckvc.inspect", "ckvc.retention", "ckvc.config", "ckvc.codecs",
    "ckvc.codecs.records", "ckvc.storage.object_store", "ckvc.storage.object_writer",
)  # fmt: skip


def test_metadata_reads_import_without_numpy() -> None:
    code = (
        f"import sys; import {', '.join(NUMPY_FREE)}; from ckvc.codecs import registry;"
        "print(sorted(m for m in sys.modules if m == 'numpy' or m.startswith('ckvc.codecs.')"
        " and m.rsplit('.', 1)[1] in registry.CODEC_MODULES))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_storage_and_metadata_import_without_torch() -> None:
    modules = torch_free_modules()
    assert "ckvc.storage.object_store" in modules and "ckvc.storage.backend" in modules
    heavy = "('torch', 'safetensors')"
    code = f"import sys; import {', '.join(modules)}; print(sorted(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


# ---- the checker itself, on synthetic packages --------------------------------------

SYNTHETIC_LAYERS = (("", "base"), ("low",), ("high",))


def make_package(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (pkg / name).write_text(text)
    return pkg


def test_checker_accepts_a_clean_package(tmp_path: Path) -> None:
    pkg = make_package(
        tmp_path,
        {
            "base.py": "def helper() -> int:\n    return 1\n",
            "low.py": "from pkg.base import helper\nfrom pkg import base\n",
            "high.py": "import pkg.low\nfrom . import low as lo\n\ndef f():\n    return lo.base.helper()\n",
        },
    )
    assert violations(pkg, "pkg", (("base",), ("low",), ("high", ""))) == {}


def test_checker_reports_exactly_a_deliberate_back_import(tmp_path: Path) -> None:
    """A lower layer importing a higher one, lazily inside a function: that one edge."""
    pkg = make_package(
        tmp_path,
        {
            "base.py": "X = 1\n",
            "low.py": "from pkg.base import X\n\ndef late():\n    from pkg.high import Y\n    return X + Y\n",
            "high.py": "Y = 2\n",
        },
    )
    assert violations(pkg, "pkg", SYNTHETIC_LAYERS) == {"layer: pkg.low -> pkg.high": {"pkg.low:4"}}


def test_checker_counts_type_checking_imports(tmp_path: Path) -> None:
    pkg = make_package(
        tmp_path,
        {
            "low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import high\n",
            "high.py": "import pkg.low\n",
        },
    )
    assert set(violations(pkg, "pkg", SYNTHETIC_LAYERS)) == {
        "layer: pkg.low -> pkg.high",
        "cycle: pkg.high <-> pkg.low",
    }


def test_checker_reports_private_names_across_modules(tmp_path: Path) -> None:
    pkg = make_package(
        tmp_path,
        {
            "base.py": "_SECRET = 1\n\nclass Thing:\n    def _hidden(self) -> int:\n        return _SECRET\n",
            "low.py": (
                "from pkg.base import _SECRET\nfrom pkg import base\n\n"
                "def f(thing):\n    return base._SECRET + thing._hidden()\n"
            ),
            "high.py": "class Own:\n    def _mine(self):\n        return 1\n\ndef g(o):\n    return o._mine()\n",
        },
    )
    assert set(violations(pkg, "pkg", SYNTHETIC_LAYERS)) == {
        "private: pkg.low imports pkg.base._SECRET",
        "private: pkg.low uses pkg.base._SECRET",
        "private: pkg.low uses thing._hidden (pkg.base defines it)",
    }


def test_checker_reports_same_layer_cycles_and_unplaced_modules(tmp_path: Path) -> None:
    pkg = make_package(tmp_path, {"low.py": "import pkg.other\n", "other.py": "from pkg import low\n"})
    assert set(violations(pkg, "pkg", SYNTHETIC_LAYERS)) == {
        "unplaced: pkg.other is in no layer (add it to LAYERS)",
        "cycle: pkg.low <-> pkg.other",
    }


def test_layers_name_each_module_once() -> None:
    names = [n for layer in LAYERS for n in layer]
    assert len(names) == len(set(names))
