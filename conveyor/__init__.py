"""Conveyor: Kubernetes-native LLM serving.

The subpackages live in the repository's top-level folders (ARCHITECTURE.md):
``conveyor.runtime`` in ``runtime/``, ``conveyor.gateway`` in ``gateway/``,
``conveyor.operator`` in ``operator/``, ``conveyor.cluster`` in ``cluster/``.
Installed, setuptools maps them. From a bare checkout on ``PYTHONPATH`` (the
GPU machine, which cannot pip install), the repository root is added to this
package's path so the same names resolve to the same folders.

``operator/`` has no ``__init__.py`` on purpose: with the repository root on
``sys.path`` (``python -c`` in the checkout), a regular package there would
shadow the standard library's ``operator`` module and break ``enum``, ``re``
and everything above them. As a namespace portion it never wins over the
standard library, and ``conveyor.operator`` still resolves to it.
"""

import os as _os

__version__ = "0.1.0"

_root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
if _os.path.isfile(_os.path.join(_root, "runtime", "__init__.py")) and _root not in __path__:
    __path__.append(_root)
