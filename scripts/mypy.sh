#!/usr/bin/env bash
# mypy over the import name horovod_airflow.* (and examples/), as the wheel lays it out.
#   scripts/mypy.sh [mypy args...]
#
# The package maps three folders under one name (pyproject.toml's package-dir: core/, trainer/,
# operators/), which the editable install resolves with setuptools' import finder; mypy reads
# files and cannot run that finder. So mypy reads a view of that layout, rebuilt on every call
# under .runs/mypy-view/ (ignored by git): horovod_airflow/ with links to the folders. The
# repository itself has no links; errors name the view's paths, which are the folders' files.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
view="$root/.runs/mypy-view"
rm -rf "$view"
mkdir -p "$view/horovod_airflow"
ln -s "$root/horovod_airflow/__init__.py" "$view/horovod_airflow/__init__.py"
for folder in core trainer operators; do ln -s "$root/$folder" "$view/horovod_airflow/$folder"; done
cd "$root"
mypy=${HVA_VENV:-$root/.venv}/bin/mypy
[ -x "$mypy" ] || mypy=mypy
MYPYPATH="$view" exec "$mypy" -p horovod_airflow -p examples "$@"
