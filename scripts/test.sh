#!/usr/bin/env bash
# Set up, then lint and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,k8s
# podman, buildah and mmdebstrap for tests/test_containers.py (Debian packages; root).
bash scripts/containers/install_engine.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check src services tests bench scripts dev
# The layers of docs/architecture.md (pyproject.toml [tool.importlinter]).
lint-imports --no-cache
# Type checks of src/ance_train (pyproject.toml [tool.mypy]: the files, plugins, overrides).
mypy
# Two workers (pytest-xdist; tests/conftest.py says how the tests are shared out): most of the
# end-to-end tests' time is services starting and waiting on one another, so on two cores two
# runs overlap well. Later arguments win: `bash scripts/test.sh -n 0` runs in one process.
# --durations: CI lists the slowest tests, to keep the suite well under 12 minutes.
python -m pytest -q -p no:cacheprovider -n 2 --dist loadgroup --durations=15 "$@"
