"""tierd: a multi-tier KV-cache offloading daemon and its engine-side connector.

Import names follow the design card: ``tierd`` (this folder), ``tierd.gpu`` (folder ``gpu/``)
and ``tierd.connector`` (folder ``connector/``), mapped by setuptools ``package-dir``.
"""

from __future__ import annotations

import os

__version__ = "0.1.0"

# Running from a source checkout (`python -m pytest` at the repository root puts the root on
# sys.path before the editable install's finder), `tierd.gpu` and `tierd.connector` live in
# sibling folders. Extend the package path to them so both import names work there too; an
# installed wheel has them inside this package and never takes this branch.
_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_root, "pyproject.toml")) and os.path.isfile(
    os.path.join(_root, "gpu", "__init__.py")
):
    __path__.append(_root)
