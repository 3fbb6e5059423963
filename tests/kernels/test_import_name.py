"""The checkout's ``kernels/`` folder never answers to the top-level name ``kernels``.

transformers imports the PyPI package ``kernels`` when it is installed (5.25 made it a dependency),
and run from the checkout's root, where ``sys.path`` starts with the root, the folder shadowed it:
every import of ``transformers.modeling_utils`` failed with "cannot import name 'CUDAProperties'".
The folder now hands that name to the installed package (``kernels/__init__.py``).
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout (this file is tests/kernels/...)


def _run(code: str, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *flags, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_transformers_models_import_from_the_checkout_root():
    proc = _run("import transformers.modeling_utils, qkv.kernels.quant, qkv.kernels; print(qkv.kernels.__file__)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(ROOT / "kernels" / "__init__.py")


def test_top_level_kernels_is_the_installed_package_not_the_folder(tmp_path):
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("CUDAProperties = 'the installed package'\n")
    code = "import kernels; from kernels import CUDAProperties; print(kernels.__file__); print(CUDAProperties)"
    proc = _run(code, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [str(site / "kernels" / "__init__.py"), "the installed package"]


def test_top_level_kernels_without_an_installed_package_stays_the_empty_folder_module():
    # -S: no site-packages, so no PyPI kernels either. transformers < 5.25 imports the name to read its
    # __version__ and rejects a module without one: that probe must still see this folder, not an error.
    code = "import kernels; print(kernels.__file__); print(hasattr(kernels, '__version__'))\nfrom kernels import Mode"
    proc = _run(code, "-S")
    assert proc.stdout.splitlines() == [str(ROOT / "kernels" / "__init__.py"), "False"]
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("ImportError: cannot import name 'Mode' from 'kernels'")
