#!/usr/bin/env bash
# mypy over the import name horovod_airflow.* (and examples/), as the wheel lays it out.
#   scripts/mypy.sh [mypy args...]
#
# mypy reads files and cannot run the editable install's import finder, so it reads a view of
# the installed layout (scripts/package_view.sh) under .runs/mypy-view/ (ignored by git); the
# repository itself has no links. Errors name the view's paths, which are the folders' files.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
view="$root/.runs/mypy-view"
bash "$root/scripts/package_view.sh" "$view"
cd "$root"
mypy=${HVA_VENV:-$root/.venv}/bin/mypy
[ -x "$mypy" ] || mypy=mypy
MYPYPATH="$view" exec "$mypy" -p horovod_airflow -p examples "$@"
