#!/usr/bin/env bash
# Run the test suite on other Pythons (or another torch) than CI's.
#
#   bash scripts/test_other_pythons.sh python3.12 python3.13
#   TORCH=2.4.0 bash scripts/test_other_pythons.sh python3.11   # the oldest torch allowed
#
# CI runs Python 3.11 with the CPU build of torch 2.13.0 from local disk. For
# each interpreter given, this makes a venv under ${VENVS:-.venvs}/<name>,
# installs torch==${TORCH:-2.13.0} (from wherever pip finds it: on Linux,
# plain PyPI serves the CUDA build, several GB; its CUDA tests skip cleanly
# without a GPU) and the project with its test extra, and runs the README's
# test command. Nothing here is part of CI: it downloads too much.
#
#   ASYNCPOOL_TEST_EAGER=1 bash scripts/test_other_pythons.sh python3.12
#
# runs every async test with asyncio.eager_task_factory set on its loop
# (asyncio and uvloop; tests/conftest.py), as engines that turn it on do;
# Python 3.12+ only (on 3.11 the suite refuses it with a usage error). The
# tests marked lazy_tasks assume a task created does not run at once: they
# keep the lazy factory.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ $# -lt 1 ]; then
  echo "usage: [TORCH=version] $0 PYTHON [PYTHON ...]" >&2
  exit 2
fi
torch_version=${TORCH:-2.13.0}
venvs=${VENVS:-.venvs}
status=0
for python in "$@"; do
  venv="$venvs/$(basename "$python")-torch$torch_version"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==$torch_version"
  "$venv/bin/python" -m pip install -q -e '.[test]'
  echo "== $("$venv/bin/python" --version), torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
  "$venv/bin/python" -m pytest -q -p no:cacheprovider || status=$?
done
exit "$status"
