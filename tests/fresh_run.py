"""Run one of the tests' helper scripts in a fresh interpreter and read its answer: the JSON object
it prints on its last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_script(script: Path, request: dict, env: dict[str, str], cwd: Path) -> dict:
    """``python script '<request as JSON>'`` in ``cwd`` with ``env``; the script must exit 0."""
    done = subprocess.run(
        [sys.executable, str(script), json.dumps(request)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
