"""CLI startup benchmark: wall time of ``ckvc COMMAND`` in a fresh process, per command.

    .venv/bin/python benchmarks/cli_startup.py [--repeats 5] [--commits 3] [--dir DIR] [--json]
                                               [--commands A,B] [--older DIR] [--no-bytecode-cache]

Before/after: ``git archive OLD ckvc | tar -x -C /tmp/old`` (copy ckvc/_native*.so
along), then ``--older /tmp/old`` times that ckvc's --help, log and status in the
same rounds.

Builds a small repository (``--commits`` commits of a 1 MiB state, a second branch, an
annotated tag), then runs each command ``--repeats`` times as ``python -m ckvc ...`` in a
new interpreter, in alternating rounds with the baseline ``python -c pass`` (so a burst of
load on a shared machine hits both alike), and prints the median seconds of each, its
ratio to the baseline, and whether the command imported torch (one extra run under
``-X importtime``). ``python -c "import torch"`` is timed alongside for scale.

Bytecode: an installed ckvc has its ``.pyc`` files, so by default the children cache
bytecode under a temporary ``PYTHONPYCACHEPREFIX`` (nothing is written next to the
sources) after one untimed warm-up run of each command, even where the environment
sets ``PYTHONDONTWRITEBYTECODE`` (this sandbox does: every run then recompiles
repo.py and the CLI, about 0.1 s more). ``--no-bytecode-cache`` measures that case.

Acceptance (issue 13): ``--help``, ``log`` and ``status`` in <= 0.3 s median and without torch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS: dict[str, list[str]] = {
    "--help": ["--help"],
    "log": ["log"],
    "log --oneline --all --graph": ["log", "--oneline", "--all", "--graph"],
    "status": ["status"],
    "branch": ["branch"],
    "tag -n": ["tag", "-n"],
    "reflog": ["reflog"],
    "config": ["config"],
    "du": ["du"],
    "show --no-data": ["show", "--no-data"],
}
ACCEPTANCE = ("--help", "log", "status")
LIMIT_S = 0.3


def build_repo(root: Path, commits: int) -> None:
    import torch

    import ckvc

    with ckvc.Repo.init(root) as repo:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(512, 512, generator=g)
        for i in range(commits):
            w = w + 0.01 * torch.randn(512, 512, generator=g)
            repo.commit({"model": {"w": w}, "epoch": i}, message=f"epoch {i}", metrics={"val_loss": 1.0 / (i + 1)})
        repo.branch("experiment", "HEAD~1")
        repo.tag("v1", "HEAD", message="first release")


def timed(argv: list[str], cwd: Path, env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, env=env)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
    return elapsed


def imports_torch(args: list[str], cwd: Path, env: dict[str, str]) -> bool:
    argv = [sys.executable, "-X", "importtime", "-m", "ckvc", *args]
    done = subprocess.run(argv, cwd=cwd, capture_output=True, env=env)
    # lines look like "import time:  63258 |  3911228 |       torch"
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in done.stderr.decode().splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--commits", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="Scratch directory (default: a temporary one).")
    parser.add_argument("--json", action="store_true", help="Also print the figures as JSON.")
    parser.add_argument(
        "--commands",
        default=None,
        metavar="A,B",
        help=f"Only these commands (default all: {','.join(COMMANDS)}); e.g. to time an older ckvc.",
    )
    parser.add_argument(
        "--older",
        type=Path,
        default=None,
        metavar="DIR",
        help="A directory holding an older ckvc package (e.g. from git archive): its --help, log and status are "
        "timed in the same rounds, as 'older ckvc ...' rows (the before/after comparison).",
    )
    parser.add_argument(
        "--no-bytecode-cache", action="store_true", help="Children compile every module (PYTHONDONTWRITEBYTECODE=1)."
    )
    args = parser.parse_args()
    commands = {n: COMMANDS[n] for n in args.commands.split(",")} if args.commands else COMMANDS
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp) / "repo"
        build_repo(root, args.commits)
        env = dict(os.environ)
        if args.no_bytecode_cache:
            env["PYTHONDONTWRITEBYTECODE"] = "1"
        else:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        baseline = [sys.executable, "-c", "pass"]
        runs: dict[str, tuple[list[str], dict[str, str]]] = {
            "python -c pass": (baseline, env),
            "python -c 'import torch'": ([sys.executable, "-c", "import torch"], env),
            **{f"ckvc {name}": ([sys.executable, "-m", "ckvc", *argv], env) for name, argv in commands.items()},
        }
        if args.older is not None:
            older_env = {**env, "PYTHONPATH": str(args.older.resolve())}
            for name in ACCEPTANCE:
                runs[f"older ckvc {name}"] = ([sys.executable, "-m", "ckvc", *COMMANDS[name]], older_env)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for argv, run_env in runs.values():  # warm-up: writes the bytecode cache (when on), warms the page cache
            timed(argv, root, run_env)
        for _ in range(args.repeats):
            for name, (argv, run_env) in runs.items():  # alternating rounds: every command once per round
                times[name].append(timed(argv, root, run_env))
        torch_used = {name: imports_torch(argv, root, env) for name, argv in commands.items()}
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["python -c pass"]
    cache = "no bytecode cache" if args.no_bytecode_cache else "bytecode cached"
    print(f"CLI startup, median of {args.repeats} fresh processes ({cache}; alternating rounds with the baseline)")
    print(f"{'command':<32} {'median s':>9} {'x pass':>7}  torch")
    for name, median in medians.items():
        command = name.removeprefix("ckvc ")
        used = "" if command not in torch_used else ("yes" if torch_used[command] else "no")
        print(f"{name:<32} {median:9.3f} {median / base:7.2f}  {used}")
    verdicts = [
        f"{c} {'ok' if medians['ckvc ' + c] <= LIMIT_S and not torch_used[c] else 'FAIL'}"
        for c in ACCEPTANCE
        if c in commands
    ]
    print(f"acceptance (<= {LIMIT_S} s, no torch): " + ", ".join(verdicts))
    if args.json:
        print(json.dumps({"medians_s": medians, "baseline_s": base, "imports_torch": torch_used}, indent=2))


if __name__ == "__main__":
    main()
