"""The S3 client of an Airflow AWS connection, for every operator that reads or writes S3.

Runs in the Airflow worker. The hook is built on first use, in ``execute``: a DAG file that
creates the operators parses without a connection lookup or network.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook


class AwsConnectionMixin:
    """``s3_hook`` and ``s3_client_for(uri)`` from the operator's ``aws_conn_id``.

    ``aws_conn_id=None`` means no Airflow connection: :mod:`horovod_airflow.core.storage` then
    builds its
    client from the standard ``AWS_*`` environment (instance role, files).
    """

    aws_conn_id: str | None

    @cached_property
    def s3_hook(self) -> S3Hook:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=self.aws_conn_id)

    def s3_client_for(self, *uris: str) -> Any | None:
        """The connection's S3 client when any of ``uris`` is ``s3://``; None for local paths."""
        if self.aws_conn_id is None or not any(u.startswith("s3://") for u in uris):
            return None
        return self.s3_hook.get_conn()
