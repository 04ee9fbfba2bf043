#!/usr/bin/env bash
# Run HERE (not on the device) before benchmarks/gpu_session.sh: downloads into .whl/ (git-ignored through
# .git/info/exclude) the wheels the device image lacks or holds too old, at the versions of this checkout's
# .venv. The device image had transformers 5.17 (2026-12-04); oal needs >= 5.24 (the `cache=` argument).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=.venv/bin/python
version() { "$PY" -m pip show "$1" | sed -n 's/^Version: //p'; }
specs=()
for name in transformers huggingface_hub kernels httpx2 httpcore2 truststore tomlkit click regex hf-xet gguf; do
  specs+=("$name==$(version "$name")")
done
platforms=()
for n in 28 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${specs[@]}"
ls -la .whl
