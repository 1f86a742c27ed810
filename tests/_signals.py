"""Children that receive Ctrl-C whatever runs the tests.

A shell starts a background job (``pytest &``, ``nohup pytest``) with SIGINT ignored, and an
ignored disposition survives ``exec``: a child started from such a pytest never sees the SIGINT a
test sends it, and Python does not install its KeyboardInterrupt handler. Tests that send SIGINT
start their child with :func:`sigint_default` as ``preexec_fn`` (and in a new session, so the
signal reaches only the child's own process group).
"""

import signal


def sigint_default() -> None:
    """Run in the child between fork and exec: SIGINT back to its default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
