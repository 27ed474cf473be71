"""What a fresh interpreter loads: the layer tests and the client's "imports Celery only" check."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterable

from tests.support.services import REPO


def loaded_by(modules: Iterable[str], *, then: str = "") -> set[str]:
    """The names in ``sys.modules`` once a fresh interpreter has imported ``modules`` (and run ``then``, a
    statement: a command's ``--help``): every import counts, however indirect."""
    script = (
        "import importlib, sys\n"
        f"for name in {sorted(modules)!r}:\n"
        "    importlib.import_module(name)\n"
        f"{then}\n"
        "print('MODULES ' + ' '.join(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith("MODULES ")]
    return set(line.split()[1:])
