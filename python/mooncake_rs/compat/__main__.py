"""``python -m mooncake_rs.compat``: prints the directory to put first on PYTHONPATH so that
another process's ``import mooncake.store`` gets the facade."""

from . import shim_path

print(shim_path())
