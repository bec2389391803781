"""The extra links the package's operators show on the task page (Airflow
``BaseOperatorLink``): from a train task to its run folder, from a publish task to the model
registry page. Airflow computes them when the task ends (the task runner stores each as the
XCom ``_link_<class>``), from the operator's rendered fields."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperatorLink

from horovod_airflow.core.contract import METRICS_NAME

if TYPE_CHECKING:
    from airflow.sdk import BaseOperator
    from airflow.sdk.types import TaskInstanceKey

#: The registry page's path in the Airflow UI: Airflow 3 shows a plugin's ``external_views``
#: entry at ``/plugin/<url_route>``, and the registry plugin (branch registry-ui,
#: ``operators/registry_plugin.py``) names its page ``model-registry``. The one place the
#: path is spelled on this side.
REGISTRY_PAGE_PATH = "/plugin/model-registry"


def airflow_url(path: str) -> str:
    """``path`` under ``[api] base_url`` when it is set, else as a same-origin path."""
    from airflow.configuration import conf

    base = (conf.get("api", "base_url", fallback="") or "").rstrip("/")
    return f"{base}{path}"


def storage_url(uri: str, client: Any = None) -> str:
    """A browser URL for a storage URI: ``file://`` for a local path; for ``s3://bucket/key``
    the AWS console's folder view on AWS, else the object's path-style URL on the
    connection's endpoint (SeaweedFS, MinIO: ``http://host:port/bucket/key``)."""
    if not uri.startswith("s3://"):
        return Path(uri).resolve().as_uri()
    bucket, _, key = uri[len("s3://") :].partition("/")
    endpoint = str(getattr(getattr(client, "meta", None), "endpoint_url", "") or "")
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    if not endpoint or host.endswith("amazonaws.com"):
        prefix = urllib.parse.quote(key.rstrip("/") + "/")
        return f"https://s3.console.aws.amazon.com/s3/buckets/{bucket}?prefix={prefix}"
    return f"{endpoint.rstrip('/')}/{bucket}/{urllib.parse.quote(key)}"


class RunFolderLink(BaseOperatorLink):
    """``Run folder`` on a train task: its output (``metrics.json``, the checkpoint)."""

    name = "Run folder"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        output = str(getattr(operator, "output_uri", "") or "")
        if not output:
            return ""
        client = operator.s3_client_for(output) if hasattr(operator, "s3_client_for") else None
        if output.startswith("s3://") and client is not None:
            return storage_url(output.rstrip("/") + "/" + METRICS_NAME, client)
        return storage_url(output, client)


class RegistryLink(BaseOperatorLink):
    """``Model registry`` on a publish task: the registry page of the Airflow UI."""

    name = "Model registry"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:
        return airflow_url(REGISTRY_PAGE_PATH)
