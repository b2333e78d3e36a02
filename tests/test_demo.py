"""The README's demo (``bash .ci/demo`` runs examples/demo.py) cleans up after itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).parent.parent / "examples" / "demo.py"


def test_demo_removes_its_repository(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(DEMO), "--epochs", "2"], capture_output=True, text=True, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # the history went to a directory remote and came back whole
    assert "pushing again sent 0 bytes" in done.stdout
    assert "clone: same branches and tags: True; all 4 checkpoints bit-identical with the same metrics: True" in (
        done.stdout
    )
    last = done.stdout.splitlines()[-1]
    assert last.startswith(f"removed the demo repository {tmp_path}/ckvc-demo-")
    assert last.endswith(" (pass --dir DIR to keep one)")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("ckvc-demo-")]
