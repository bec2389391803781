"""OpenLineage for the train and publish tasks, through the OpenLineage provider's operator
hooks (``get_openlineage_facets_on_complete``): the provider's listener calls them when it is
installed (``pip install 'horovod-airflow[openlineage]'``) and configured; without it nothing
here is imported or run.

Datasets follow OpenLineage's naming: ``s3://bucket/key`` → namespace ``s3://bucket``, name
``key``; a local path → namespace ``file``, name the absolute path.

- train: input the staged dataset (``data``), output the run folder (checkpoint, metrics);
- publish: inputs the run folder and the staged dataset the model was trained on, output the
  published version's folder in the registry (``models/<name>/<version>``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any


def dataset_name(uri: str) -> tuple[str, str]:
    """(namespace, name) of a storage URI in OpenLineage's naming."""
    if uri.startswith("s3://"):
        bucket, _, key = uri[len("s3://") :].partition("/")
        return f"s3://{bucket}", key.rstrip("/") or "/"
    return "file", str(Path(uri).resolve())


def operator_lineage(inputs: Iterable[str], outputs: Iterable[str]) -> Any:
    """The provider's ``OperatorLineage`` of these input and output URIs (empty ones left out)."""
    from airflow.providers.common.compat.openlineage.facet import Dataset
    from airflow.providers.openlineage.extractors import OperatorLineage

    def datasets(uris: Iterable[str]) -> list[Any]:
        out = []
        for uri in uris:
            if uri:
                namespace, name = dataset_name(uri)
                out.append(Dataset(namespace=namespace, name=name))
        return out

    return OperatorLineage(inputs=datasets(inputs), outputs=datasets(outputs))
