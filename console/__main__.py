"""``python -m console``: the ``longcall`` command."""

import sys

from console.main import main

sys.exit(main(prog_name="longcall"))
