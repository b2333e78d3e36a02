"""Running a function on several gloo ranks, each a spawned local process.

``run_world(world, fn, args)`` starts ``world`` processes; each joins a gloo
process group (a FileStore rendezvous in a fresh temporary file, so no port is
chosen or raced for), calls ``fn(rank, world, *args)``, and writes what it
returns as JSON. Returns the per-rank results; a rank that died (SIGKILL) gives
None. Rank functions live in importable modules (imported by name).

Ranks fork from the test session's preloaded server (tests/preloaded.py: torch,
ckvc and the rank modules imported once): a rank starts in a fraction of a
second instead of importing torch anew (about 3 s each on a loaded 2-core
machine), with the caller's environment and working directory."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from preloaded import CONTEXT, become

# Long enough for torch to import on a loaded 2-core machine; a run past it is a hang.
JOIN_TIMEOUT_S = 240.0


def _rank_main(
    fn: Callable[..., Any], rank: int, world: int, store: str, out: str, args: Sequence[Any],
    env: dict[str, str], cwd: str,
) -> None:  # fmt: skip
    import torch.distributed as dist

    become(env, cwd)

    os.environ.setdefault("CKVC_AUTHOR", "ranks@test")
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        result: Any = fn(rank, world, *args)
    except BaseException as exc:  # reported to the test, which asserts on it
        result = {"unexpected": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
    Path(out).write_text(json.dumps(result))
    # No destroy_process_group: its barrier would hang on a world that lost a rank.
    os._exit(0)


def run_world(world: int, fn: Callable[..., Any], args: Sequence[Any] = ()) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="ckvc-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        env, cwd = dict(os.environ), os.getcwd()
        procs = [
            CONTEXT.Process(target=_rank_main, args=(fn, r, world, store, outs[r], tuple(args), env, cwd))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(JOIN_TIMEOUT_S)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        assert not hung, f"ranks {hung} did not finish within {JOIN_TIMEOUT_S} s"
        results = [json.loads(Path(o).read_text()) if os.path.exists(o) else None for o in outs]
    for r, res in enumerate(results):
        assert not (isinstance(res, dict) and "unexpected" in res), f"rank {r}: {res['traceback']}"
    return results
