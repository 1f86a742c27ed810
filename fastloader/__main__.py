"""``python -m fastloader``: the ``fastloader`` command (see fastloader/cli.py)."""

from fastloader.cli import fastloader_main

raise SystemExit(fastloader_main())
