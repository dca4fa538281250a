"""`ddpkit run -m MODULE`: the module is found before any worker starts, as `python -m MODULE` would find it
(the working folder first on the path), so a typo is one line instead of a traceback from every rank."""

from __future__ import annotations

import importlib.util
import os
import sys

from ddpkit.errors import UserError, first_line


def check_module(name: str) -> None:
    """UserError when `python -m NAME` would not find NAME (or NAME is a package without __main__)."""
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:  # a package: runs its __main__
            spec = importlib.util.find_spec(f"{name}.__main__")
    except ModuleNotFoundError:
        spec = None
    except Exception as e:  # a parent package that fails to import, an empty or relative name
        raise UserError(
            f"module '{first_line(name, 50)}' cannot be looked up: {first_line(e, 70)}",
            "check the name after -m",
        ) from None
    finally:
        sys.path.pop(0)
    if spec is None:
        raise UserError(
            f"no module named '{first_line(name, 60)}'",
            "check the name after -m (looked up from this folder and the installed packages)",
        )
