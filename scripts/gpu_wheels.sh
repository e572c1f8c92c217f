#!/usr/bin/env bash
# Download, into the git-ignored folder .whl/, the wheels a GPU machine without network access needs to run mii
# and scripts/gpu_check.sh: the packages its image lacks (it has torch, triton, transformers, tokenizers,
# safetensors, numpy, jinja2, httpx, prometheus-client, ...). Versions are the ones installed in .venv here, so the
# GPU runs the set of packages CI tests; grpcio/grpcio-tools/protobuf travel together (grpcio-tools generates
# mii's protobuf modules at import and must match the grpcio and protobuf runtime).
#
#   scripts/gpu_wheels.sh [PYTHON_VERSION]        (default 3.12, the H200 image's)
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${1:-3.12}"
PY=.venv/bin/python
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo '/.whl/' >> .git/info/exclude; }
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
PACKAGES="pydantic pydantic-core annotated-types typing-inspection fastapi starlette uvicorn gguf
          grpcio grpcio-tools grpcio-health-checking protobuf openai jiter sniffio httpx2 httpcore2 truststore
          opentelemetry-api anyio typing-extensions annotated-doc"
mkdir -p .whl
for name in $PACKAGES; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  [ -n "$version" ] || { echo "gpu_wheels: $name is not installed in .venv" >&2; exit 1; }
  ls .whl/ | grep -qi "^${name//-/_}-${version}-" && continue
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d .whl "$name==$version"
done
du -sh .whl
