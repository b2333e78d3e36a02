"""Re-validation: does a checkpoint still perform as it did when it was saved?

``validate`` loads a commit, runs the user's evaluation on the loaded state, compares
what it returns with the metrics the commit recorded (its own, and notes that are not
earlier validations), and records the outcome as a note (ckvc.notes):
``validated: ok`` or ``validated: MISMATCH val_loss 0.412 vs 0.398 recorded``. The
CLI runs the evaluation in a fresh interpreter (``python -m ckvc.validate``), so an
evaluation that leaks memory, holds a GPU or crashes takes nothing else with it.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckvc.errors import EvaluationFailedError, InvalidInputError

if TYPE_CHECKING:
    from ckvc.core import Repository
    from ckvc.notes import Note

VALIDATED_KEY = "ckvc.validated"  # a validation note's metadata: {"outcome": "ok"|"mismatch", ...}
RESULT_MARK = "ckvc-validate-result:"


@dataclass
class Validation:
    commit: str
    ok: bool
    compared: dict[str, tuple[float, float]] = field(default_factory=dict)  # metric -> (measured, recorded)
    mismatched: list[str] = field(default_factory=list)
    unrecorded: dict[str, float] = field(default_factory=dict)  # measured, nothing recorded to compare with
    note: Note | None = None

    def summary(self) -> str:
        if self.ok:
            shown = ", ".join(f"{k} {m:.6g}" for k, (m, _) in self.compared.items())
            return f"validated: ok ({shown})"
        parts = [f"{k} {self.compared[k][0]:.6g} vs {self.compared[k][1]:.6g} recorded" for k in self.mismatched]
        return "validated: MISMATCH " + "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "commit": self.commit,
            "ok": self.ok,
            "compared": {k: {"measured": m, "recorded": r} for k, (m, r) in self.compared.items()},
            "mismatched": self.mismatched,
            "unrecorded": self.unrecorded,
            "summary": self.summary(),
            "note": None if self.note is None else self.note.id,
        }


def as_metrics(result: Any, metric: str | None) -> dict[str, float]:
    """What an evaluation returned, as metrics: a number (named ``metric``) or a
    mapping of names to numbers."""
    if isinstance(result, Mapping):
        out = {}
        for k, v in result.items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int | float):
                raise EvaluationFailedError(f"the evaluation returned {k!r}: {v!r}; expected names to numbers")
            out[k] = float(v)
        return {metric: out[metric]} if metric is not None and metric in out else out
    if isinstance(result, bool) or not isinstance(result, int | float):
        if hasattr(result, "item"):  # a 0-d tensor or numpy scalar
            try:
                number = result.item()
            except (ValueError, RuntimeError) as exc:
                raise EvaluationFailedError(f"the evaluation returned {type(result).__name__}: {exc}") from None
            return as_metrics(number, metric)
        raise EvaluationFailedError(f"the evaluation returned {type(result).__name__}; expected a number or a dict")
    if metric is None:
        raise InvalidInputError("the evaluation returned one number: name the metric it measures (--metric NAME)")
    return {metric: float(result)}


def compare(
    commit_id: str, measured: Mapping[str, float], recorded: Mapping[str, float], *, rtol: float, atol: float
) -> Validation:
    if rtol < 0 or atol < 0:
        raise InvalidInputError("rtol and atol must be non-negative")
    result = Validation(commit_id, ok=True)
    for name, value in measured.items():
        if name not in recorded:
            result.unrecorded[name] = value
            continue
        was = float(recorded[name])
        result.compared[name] = (value, was)
        if not (math.isclose(value, was, rel_tol=rtol, abs_tol=atol) or (math.isnan(value) and math.isnan(was))):
            result.mismatched.append(name)
    if not result.compared:
        names = ", ".join(sorted(measured)) or "nothing"
        raise InvalidInputError(
            f"commit {commit_id[:12]} recorded none of what the evaluation measured ({names}); "
            f"it recorded: {', '.join(sorted(recorded)) or 'no metrics'}"
        )
    result.ok = not result.mismatched
    return result


def recorded_metrics(core: Repository, commit_id: str) -> dict[str, float]:
    """The metrics a validation compares with: the commit's, updated by its notes,
    leaving out earlier validations' notes."""
    from ckvc.notes import metrics_with_notes, notes_of

    notes = [n for n in notes_of(core, commit_id) if VALIDATED_KEY not in n.metadata]
    return metrics_with_notes(core.read_commit(commit_id), notes)


def _load(core: Repository, commit_id: str) -> Any:
    from ckvc import graph, read

    return read.load_state(core, graph.readable_commit(core, commit_id), map_location="cpu")


def validate(
    core: Repository,
    rev: str,
    evaluate: Callable[[Any], Any] | str,
    *,
    metric: str | None = None,
    rtol: float = 1e-6,
    atol: float = 0.0,
    record: bool = True,
    fresh_process: bool = False,
) -> Validation:
    """Load ``rev``, run ``evaluate(state)`` (a callable, or "module:function" to
    import; with ``fresh_process`` it runs in a new interpreter), compare with the
    recorded metrics within ``rtol``/``atol``, and (``record``) add a note saying so."""
    from ckvc import graph
    from ckvc.notes import add_note

    commit_id = graph.resolve(core, rev)
    if fresh_process:
        if not isinstance(evaluate, str):
            raise InvalidInputError("a fresh process imports the evaluation: give it as 'module:function'")
        measured = _evaluate_in_subprocess(core, commit_id, evaluate, metric)
    else:
        fn = resolve_function(evaluate) if isinstance(evaluate, str) else evaluate
        state = _load(core, commit_id)
        try:
            returned = fn(state)
        except Exception as exc:
            failed = f"the evaluation of {commit_id[:12]} raised {type(exc).__name__}: {exc}"
            raise EvaluationFailedError(failed) from exc
        measured = as_metrics(returned, metric)
    result = compare(commit_id, measured, recorded_metrics(core, commit_id), rtol=rtol, atol=atol)
    if record:
        outcome = {
            "outcome": "ok" if result.ok else "mismatch",
            "measured": dict(measured),
            "recorded": {k: r for k, (_, r) in result.compared.items()},
            "rtol": rtol,
            "atol": atol,
        }
        target = evaluate if isinstance(evaluate, str) else getattr(evaluate, "__qualname__", repr(evaluate))
        outcome["evaluation"] = target
        result.note = add_note(core, commit_id, metadata={VALIDATED_KEY: outcome}, message=result.summary())
    return result


def resolve_function(target: str) -> Callable[[Any], Any]:
    """``module:function`` (the current directory importable, as ``python -m`` has it)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidInputError(f"--eval takes MODULE:FUNCTION, got {target!r}")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidInputError(f"cannot import {module_name!r}: {exc}") from None
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)  # type: ignore[assignment]
        if fn is None:
            raise InvalidInputError(f"{module_name!r} has no {attr!r}")
    if not callable(fn):
        raise InvalidInputError(f"{target} is not callable")
    return fn


def _evaluate_in_subprocess(core: Repository, commit_id: str, target: str, metric: str | None) -> dict[str, float]:
    args = [sys.executable, "-m", "ckvc.validate", str(core.local_path), commit_id, target, metric or ""]
    done = subprocess.run(args, capture_output=True, text=True, check=False, cwd=os.getcwd())
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            try:
                payload = json.loads(line[len(RESULT_MARK) :])
                if "error" in payload:
                    raise EvaluationFailedError(payload["error"])
                return {str(k): float(v) for k, v in payload["metrics"].items()}
            except (ValueError, TypeError, AttributeError, KeyError):
                malformed = f"the evaluation process printed a malformed result: {line[:200]}"
                raise EvaluationFailedError(malformed) from None
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    raise EvaluationFailedError(f"the evaluation process ended with status {done.returncode}: {tail[0]}")


def _main(argv: list[str]) -> int:
    """The fresh interpreter's side: load, evaluate, print the metrics on one marked line."""
    path, commit_id, target, metric = argv
    from ckvc.core import Repository

    try:
        fn = resolve_function(target)
        core = Repository.open_local(path)
        try:
            state = _load(core, commit_id)
        finally:
            core.close()
        metrics = as_metrics(fn(state), metric or None)
        print(RESULT_MARK + json.dumps({"metrics": metrics}))
    except Exception as exc:  # reported to the parent, which raises it typed
        print(RESULT_MARK + json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
