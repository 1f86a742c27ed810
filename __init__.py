"""Not the package: the root of a clone of fastloader's repository (the package is the
``fastloader/`` folder inside it).

NOTE [ The clone's folder as `fastloader` ]
Python started in the folder that holds a clone named ``fastloader`` finds the clone itself
when it imports ``fastloader`` (the current directory comes first on ``sys.path``). Without this
file the clone was an empty namespace package, and an editable install's import hook, which runs
only after that search, never got a say: ``AttributeError: module 'fastloader' has no attribute
'DataLoader'`` (pypa/setuptools#3548). With it, importing the clone hands over to the package an
installation provides (a wheel, an editable install of this or another clone), and where there
is none, raises an ImportError that says what happened. Imported under any other name (a clone
named otherwise), it does nothing.
"""

import importlib.machinery
import importlib.util
import os
import sys


def _hand_over() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    parent = os.path.dirname(here)
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != parent]
    spec = importlib.machinery.PathFinder.find_spec(__name__, elsewhere)
    for finder in sys.meta_path:  # an editable install's import hook
        if spec is not None:
            break
        if finder is not importlib.machinery.PathFinder and hasattr(finder, "find_spec"):
            spec = finder.find_spec(__name__, None)
    if spec is None or spec.origin is None or os.path.dirname(spec.origin) == here:
        raise ImportError(
            f"`import fastloader` found {here}, a clone of fastloader's repository, because "
            f"Python runs in the folder that holds it ({parent}); the package is the fastloader "
            "folder inside it. Run Python from inside the clone or from anywhere else, or "
            "install it (README: Set up)",
            name=__name__,
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module  # what `import fastloader` returns
    spec.loader.exec_module(module)


if __name__ == "fastloader":
    _hand_over()
