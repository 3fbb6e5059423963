"""Cache-write and paged-attention kernels (Triton) with torch references. Installed as qkv.kernels.

In a checkout this folder is also importable as a top-level ``kernels`` whenever the checkout's root is on
``sys.path`` (``python -m ...`` or ``python -c`` run there). That name belongs to the PyPI package
transformers imports when it is installed (its hub kernels), and this folder would shadow it. So when
imported under that name, the module replaces itself in ``sys.modules`` with the installed package, the
one thing an importer of ``kernels`` can mean. Where none is installed it stays this empty module, which
transformers' probe (older versions import the name to read its ``__version__``) rejects as before.
"""

if __name__ == "kernels":
    import importlib
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _self = sys.modules.pop("kernels")
    _saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    try:
        sys.modules["kernels"] = importlib.import_module("kernels")
    except ModuleNotFoundError:
        sys.modules["kernels"] = _self
    finally:
        sys.path[:] = _saved
