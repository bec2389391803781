"""``PublishModelOperator``: copy a gated model into the registry and point ``latest.json`` at it.

Runs in the Airflow worker; needs no torch. The registry layout, the idempotent copy and the
conditional write of ``latest.json`` are
:func:`horovod_airflow.operators.model_registry.publish_model`'s;
this module wires it to Airflow: templated settings, the run's version name, the
connection's S3 client, the XCom and the Asset event.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import Asset, BaseOperator

from horovod_airflow.core import storage
from horovod_airflow.core.contract import GATE, GATE_NAME, VERSION_MANIFEST_NAME
from horovod_airflow.operators.connection import AwsConnectionMixin
from horovod_airflow.operators.exceptions import HorovodConfigError
from horovod_airflow.operators.job import (
    as_mapping,
    check_name,
    check_upstream,
    check_uri,
    is_templated,
)
from horovod_airflow.operators.links import RegistryLink
from horovod_airflow.operators.model_registry import (
    RunModel,
    asset_event_extra,
    publish_model,
    run_version,
)
from horovod_airflow.operators.model_registry.refused import candidate_prefix, record_refused
from horovod_airflow.operators.retry import with_retry_policy

if TYPE_CHECKING:
    from airflow.sdk import Context


class _RegistryWriter(AwsConnectionMixin, BaseOperator):
    """What both registry writers take from a run and how they check it: the run folder
    (``metrics``), the export (``exported``) and the staged data (``dataset``), each an
    upstream task's XCom, checked cheaply in ``__init__`` and in full once rendered."""

    template_fields: Sequence[str] = ("bucket_uri", "model_name", "metrics", "exported", "dataset")
    template_fields_renderers = {  # noqa: RUF012
        "metrics": "json",
        "exported": "json",
        "dataset": "json",
    }
    operator_extra_links = (RegistryLink(),)

    def __init__(
        self,
        *,
        bucket_uri: str,
        model_name: str,
        metrics: Any,
        exported: Any,
        dataset: Any,
        aws_conn_id: str | None = "aws_default",
        **kwargs: Any,
    ) -> None:
        super().__init__(**with_retry_policy(kwargs))
        check_uri(bucket_uri, "bucket_uri")
        if not is_templated(model_name):
            check_name(model_name, "model_name")
        check_upstream(metrics, "metrics", ("output",))
        check_upstream(exported, "exported", ("onnx_uri", "parity_uri"))
        check_upstream(dataset, "dataset")
        self.bucket_uri = bucket_uri
        self.model_name = model_name
        self.metrics = metrics
        self.exported = exported
        self.dataset = dataset
        self.aws_conn_id = aws_conn_id

    def _rendered_run(
        self, context: Context, *, version: str | None = None, gate: dict[str, Any] | None = None
    ) -> tuple[RunModel, Any]:
        """The rendered fields, validated, as the registry's :class:`RunModel` of this DAG
        run, and the S3 client for it. ``version`` None: the version named by the run;
        ``gate`` None: the run's own ``gate.json`` (the one its gate task wrote). A bad field
        fails the task without a retry (:class:`HorovodConfigError`)."""
        try:
            metrics = as_mapping(self.metrics, "metrics", ("output",))
            exported = as_mapping(self.exported, "exported", ("onnx_uri", "parity_uri"))
            self.bucket_uri = check_uri(self.bucket_uri, "bucket_uri")
            model_name = check_name(self.model_name, "model_name")
            run_output = check_uri(metrics["output"], "metrics['output']")
            onnx_uri = check_uri(exported["onnx_uri"], "exported['onnx_uri']")
            parity_uri = check_uri(exported["parity_uri"], "exported['parity_uri']")
            dataset = dict(as_mapping(self.dataset, "dataset"))
            if version is None:
                dag_run = context["dag_run"]
                version = run_version(dag_run.dag_id, str(context["run_id"]), dag_run.run_after)
            version = check_name(version, "version")
        except ValueError as e:
            raise HorovodConfigError(f"{self.task_id}: {e}") from e
        client = self.s3_client_for(self.bucket_uri, run_output, onnx_uri)
        if gate is None:
            gate_uri = storage.join(run_output, GATE_NAME)
            gate = GATE.loads(storage.read_text(gate_uri, client=client), gate_uri)
        dag_run_id = str(context["run_id"])  # the locals are RunModel's fields, in its order
        run = RunModel(
            model_name, version, run_output, onnx_uri, parity_uri, dataset, gate, dag_run_id
        )
        return run, client


class PublishModelOperator(_RegistryWriter):
    """Publish a gated, exported model to ``<bucket_uri>/models/<model_name>/<version>/``.

    Copies the ONNX model, checkpoint, metrics, parity report, training curves and a summary,
    writes the version's sha256 ``manifest.json``, then ``latest.json`` — last, so a reader
    never sees a half-published model. ``latest.json`` is written only if it is still the one
    the gate compared against (``decision["champion_etag"]``, a conditional put); otherwise
    the task fails without retrying (``ChampionChangedError``) and overwrites nothing. A
    decision that did not pass, or a failed ONNX parity, is refused (``PublishRefusedError``).

    The version is named by the DAG run (``v<run_after>-<hash of dag_id and run_id>``) unless
    ``version`` is given, so a retry finds its own version and publishes nothing twice.

    Returns (as XCom) the ``latest.json`` document: ``model``, ``version``, ``uri``,
    ``manifest_uri``, ``onnx_uri``, ``onnx_sha256``, ``val_accuracy``, ``dataset_uri``,
    ``dataset_content_hash``, ``dag_run_id``, ``published_at``. Each Asset in ``outlets``
    (declare the one of ``latest.json``) gets an event whose ``extra`` holds what a consumer
    needs without a lookup (:func:`horovod_airflow.operators.model_registry.asset_event_extra`).

    :param bucket_uri: the registry's bucket, ``s3://bucket`` or a local folder (templated).
    :param model_name: the registry name of the model, e.g. ``mnist_cnn`` (templated).
    :param metrics: the train task's XCom (``train.output``): ``output``, the run's output
        URI holding ``metrics.json`` and ``checkpoint.pt`` (templated).
    :param exported: the export task's XCom (``export.output``): ``onnx_uri`` and
        ``parity_uri`` (templated).
    :param dataset: the staging task's XCom: ``uri`` and ``content_hash`` (templated).
    :param decision: the gate's XCom (``gate.output``): a passed decision with its
        ``champion_etag`` (templated).
    :param version: the version name; None: named by the DAG run (templated).
    :param aws_conn_id: the Airflow AWS connection; None: the standard ``AWS_*`` environment.
    """

    template_fields: Sequence[str] = (*_RegistryWriter.template_fields, "decision", "version")
    template_fields_renderers = {  # noqa: RUF012
        **_RegistryWriter.template_fields_renderers,
        "decision": "json",
    }
    ui_color = "#dff3e3"

    def __init__(self, *, decision: Any, version: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        check_upstream(decision, "decision", ("passed",))
        if version is not None and not is_templated(version):
            check_name(version, "version")
        self.decision = decision
        self.version = version

    def execute(self, context: Context) -> dict[str, Any]:
        try:
            gate = dict(as_mapping(self.decision, "decision", ("passed",)))
        except ValueError as e:
            raise HorovodConfigError(f"{self.task_id}: {e}") from e
        run, client = self._rendered_run(context, version=self.version, gate=gate)
        latest = publish_model(self.bucket_uri, run, client=client)
        extra = asset_event_extra(latest)
        for outlet in self.outlets:
            if isinstance(outlet, Asset):
                context["outlet_events"][outlet].extra = extra
        self._lineage = (run.run_output, latest.get("dataset_uri") or "", latest["uri"])
        return latest

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage (the provider's hook): the run folder and its dataset in, the
        published version out (nothing when this try published nothing)."""
        from horovod_airflow.operators.lineage import operator_lineage

        lineage = getattr(self, "_lineage", None)
        if lineage is None:
            return operator_lineage([], [])
        run_output, dataset_uri, version_uri = lineage
        return operator_lineage([run_output, dataset_uri], [version_uri])


class RecordRefusedOperator(_RegistryWriter):
    """Keep the exported model of a run the gate refused as a *refused candidate* of the
    registry (``<bucket_uri>/models/<model_name>/refused/<version>/``), where serving never
    looks, so that an admin can promote it later with a recorded override reason (the
    registry page, ``python -m horovod_airflow.operators.model_registry promote --override``).

    Runs after the export, on the branch the gate leaves when it refuses (the gate then skips
    ``publish``); after a gate that passed it skips itself (``AirflowSkipException``). It
    never reads or writes ``latest.json`` and emits no Asset event: a refused run changes
    nothing serving uses. The decision is the run's own ``gate.json`` (next to
    ``metrics.json``), the one the gate wrote. The version is the one the run would have
    published (named by the DAG run), so a retry finds its own candidate.

    Returns (as XCom) ``model``, ``version``, ``uri``, ``manifest_uri``, ``val_accuracy``,
    ``gate_reason`` of the candidate, or ``{"recorded": False, ...}`` when the version is
    published already.

    :param bucket_uri: the registry's bucket, ``s3://bucket`` or a local folder (templated).
    :param model_name: the registry name of the model (templated).
    :param metrics: the train task's XCom (``output``: the run folder with ``gate.json``)
        (templated).
    :param exported: the export task's XCom (``onnx_uri``, ``parity_uri``) (templated).
    :param dataset: the staging task's XCom (``uri``, ``content_hash``) (templated).
    :param aws_conn_id: the Airflow AWS connection; None: the standard ``AWS_*`` environment.
    """

    ui_color = "#f6e0e0"

    def execute(self, context: Context) -> dict[str, Any]:
        run, client = self._rendered_run(context)
        if run.gate["passed"]:
            from airflow.sdk.exceptions import AirflowSkipException

            raise AirflowSkipException(f"the gate passed ({run.gate['reason']}): the run publishes")
        manifest = record_refused(self.bucket_uri, run, client=client)
        if manifest is None:
            return {"recorded": False, "model": run.model_name, "version": run.version}
        prefix = candidate_prefix(self.bucket_uri, run.model_name, run.version)
        self.log.info(
            "refused (%s): kept as the refused candidate %s at %s; latest.json unchanged. An "
            "admin may promote it with an override reason from the registry page",
            run.gate["reason"],
            run.version,
            prefix,
        )
        return {
            "recorded": True,
            "model": run.model_name,
            "version": run.version,
            "uri": prefix,
            "manifest_uri": storage.join(prefix, VERSION_MANIFEST_NAME),
            "val_accuracy": manifest["metrics"].get("val_accuracy"),
            "gate_reason": run.gate["reason"],
        }
