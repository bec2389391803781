"""The package as an Airflow provider: the ``apache_airflow_provider`` entry point
(pyproject.toml) names :func:`get_provider_info`, which ``airflow providers list`` and the UI
read. The package brings no connection type of its own (it uses the Amazon provider's
``aws``); it brings the extra links of :mod:`horovod_airflow.operators.links`."""

from __future__ import annotations

from typing import Any

import horovod_airflow

PACKAGE_NAME = "horovod-airflow"


def get_provider_info() -> dict[str, Any]:
    """The provider info Airflow's ProvidersManager reads (its provider_info schema)."""
    return {
        "package-name": PACKAGE_NAME,
        "name": "Horovod (horovod-airflow)",
        "description": "Distributed PyTorch training with Horovod from Airflow: stage to S3, "
        "train, gate, export ONNX, publish to a model registry.",
        "versions": [horovod_airflow.__version__],
        "integrations": [
            {
                "integration-name": "Horovod",
                "external-doc-url": "https://horovod.readthedocs.io/",
                "tags": ["software"],
            }
        ],
        "operators": [
            {
                "integration-name": "Horovod",
                "python-modules": [
                    "horovod_airflow.operators.train",
                    "horovod_airflow.operators.export",
                    "horovod_airflow.operators.gate",
                    "horovod_airflow.operators.publish",
                ],
            }
        ],
        "connection-types": [],
        "extra-links": [
            "horovod_airflow.operators.links.RunFolderLink",
            "horovod_airflow.operators.links.RegistryLink",
        ],
    }
