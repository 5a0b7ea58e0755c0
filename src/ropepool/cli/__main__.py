"""``python -m ropepool.cli``: the ``ropepool`` command (the console script of pyproject.toml)."""
import sys

from . import main

sys.exit(main())
