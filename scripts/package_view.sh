#!/usr/bin/env bash
# Lay out the import name horovod_airflow.* as the wheel does, under DIR, from this checkout:
#   scripts/package_view.sh DIR     # then: PYTHONPATH=DIR (or MYPYPATH=DIR)
#
# pyproject.toml's package-dir maps four folders (core/, trainer/, operators/, apps/) under one name;
# an installed wheel or the editable install (setuptools' import finder) gives a Python that
# name. What neither reaches reads this view instead: mypy (it reads files and cannot run the
# finder) and the GPU device (its Python holds torch but not this project). DIR/horovod_airflow
# holds links to the folders, made anew on every call; DIR is the caller's (under .runs/ or $OUT).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
view=${1:?usage: scripts/package_view.sh DIR}
rm -rf "$view/horovod_airflow"
mkdir -p "$view/horovod_airflow"
ln -s "$root/horovod_airflow/__init__.py" "$view/horovod_airflow/__init__.py"
for folder in core trainer operators apps; do ln -s "$root/$folder" "$view/horovod_airflow/$folder"; done
