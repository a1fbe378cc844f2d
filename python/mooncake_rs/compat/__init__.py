"""Compatibility layers that let engines we did not write use our pool unchanged.

``install_as_mooncake()`` registers ``mooncake_rs.compat.mooncake_store`` as the module
``mooncake.store`` (and a ``mooncake`` package holding it), the way PyMySQL offers
``install_as_MySQLdb()``: an integration that does ``from mooncake.store import
MooncakeDistributedStore, ReplicateConfig`` then gets our facade. For a process you do
not start yourself (a vLLM engine core, an SGLang scheduler), put the directory printed
by ``python -m mooncake_rs.compat`` first on its ``PYTHONPATH``: it holds a ``mooncake``
package that forwards to the facade.
"""

from __future__ import annotations

import os
import sys
import types

__all__ = ["install_as_mooncake", "shim_path"]


def install_as_mooncake() -> types.ModuleType:
    """Makes ``import mooncake.store`` give the facade in this process; returns it."""
    from . import mooncake_store

    pkg = sys.modules.get("mooncake")
    if pkg is None or not hasattr(pkg, "__path__"):
        pkg = types.ModuleType("mooncake")
        pkg.__path__ = []  # a package, so `import mooncake.store` looks in sys.modules
        setattr(pkg, "__mooncake_rs_shim__", True)  # marks a package made here, not the real one
        sys.modules["mooncake"] = pkg
    sys.modules["mooncake.store"] = mooncake_store
    pkg.store = mooncake_store  # type: ignore[attr-defined]
    return mooncake_store


def shim_path() -> str:
    """The directory to put first on ``PYTHONPATH`` so that another process's ``import
    mooncake.store`` finds the facade."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "shim")
