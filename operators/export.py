"""``HorovodExportOperator``: export a checkpoint to ONNX and check parity, as one process.

``python -m horovod_airflow.trainer export --checkpoint C --output O [--data D]`` runs through the
same
launchers as training, so the export works where the Airflow worker has no torch: as a
process (local) or one container (docker), without horovodrun; on Kubernetes as a one-rank
MPIJob (``horovodrun -np 1`` on one worker pod), so that it shares the training's image,
credential Secret, cleanup policy and deferrable trigger. Returns what
``<output>/parity.json`` says.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from horovod_airflow.core.contract import ONNX_NAME, PARITY, PARITY_NAME
from horovod_airflow.operators.command import EXPORT_ENTRYPOINT, trainer_args_to_argv
from horovod_airflow.operators.exceptions import HorovodTrainingError
from horovod_airflow.operators.job import HorovodJobOperatorBase, is_templated
from horovod_airflow.operators.launchers.base import JobSpec

if TYPE_CHECKING:
    from airflow.sdk import Context


class HorovodExportOperator(HorovodJobOperatorBase):
    """Run the trainer's export (checkpoint → ``model.onnx`` + ``parity.json``) as one process.

    :param checkpoint: URI of ``checkpoint.pt`` (templated).
    :param output: URI that receives ``model.onnx`` and ``parity.json`` (templated).
    :param data: dataset URI used for the parity check; None → the program's default (templated).
    :param entrypoint: default ``python -m horovod_airflow.trainer export``.
    :param export_args: extra arguments, dict or list, as for ``trainer_args`` (templated).
    :param require_parity: raise ``HorovodTrainingError`` when parity.json says not passed.

    Returns ``{onnx_uri, parity_uri, max_abs_diff, argmax_mismatches, passed}``.
    ``launcher="kubernetes"`` runs it as a one-rank MPIJob (``slots_per_worker`` is ignored:
    one worker pod with ``gpus_per_proc`` GPUs); ``deferrable=True`` applies there too. The
    export is one process: ``LocalOptions``' hosts, ssh settings and ``horovodrun_args``
    (training's) are not used, so train and export can share one set of options.
    """

    template_fields: Sequence[str] = (
        "launcher",
        "checkpoint",
        "output_uri",
        "data",
        "export_args",
        "env",
        "image",
    )

    def __init__(
        self,
        *,
        checkpoint: str,
        output: str,
        data: str | None = None,
        entrypoint: Sequence[str] = EXPORT_ENTRYPOINT,
        export_args: Mapping[str, Any] | Sequence[str] | None = None,
        require_parity: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        for field, value in (("checkpoint", checkpoint), ("output", output)):
            if not value or not isinstance(value, str):
                raise ValueError(f"{field} must be a URI (s3://... or a path), got {value!r}")
        if data is not None and not isinstance(data, str):
            raise ValueError(f"data must be a URI or None, got {data!r}")
        if isinstance(entrypoint, str) or not entrypoint:
            raise ValueError(f"entrypoint must be a non-empty list of strings, got {entrypoint!r}")
        if export_args is not None and not is_templated(export_args):
            trainer_args_to_argv(export_args)
        self.checkpoint = checkpoint
        self.output_uri = output
        self.data = data
        self.entrypoint = tuple(entrypoint)
        self.export_args = export_args
        self.require_parity = require_parity

    def build_spec(self, context: Context) -> JobSpec:
        self.check_launcher_settings()
        argv = [*self.entrypoint, "--checkpoint", self.checkpoint, "--output", self.output_uri]
        if self.data:
            argv += ["--data", self.data]
        argv += trainer_args_to_argv(self.export_args)
        public, secret = self.job_env()
        name, labels = self.job_identity(context)
        return JobSpec(
            name=name,
            argv=argv,
            env=public,
            secret_env=secret,
            num_proc=1,
            gpus_per_proc=self.gpus_per_proc,
            distributed=False,
            labels=labels,
        )

    def execute(self, context: Context) -> dict[str, Any]:
        self.start_clock()
        spec = self.build_spec(context)
        self.log.info("exporting with %s: %s", self.launcher, shlex.join(spec.argv))
        self.run_job(spec, context)
        return self.collect_result()

    def collect_result(self) -> dict[str, Any]:
        """Read ``<output>/parity.json``; raise when it failed and ``require_parity`` is set."""
        from horovod_airflow.core import storage

        parity_uri = storage.join(self.output_uri, PARITY_NAME)
        parity = self.read_json(parity_uri, PARITY_NAME, PARITY)
        result = {
            "onnx_uri": storage.join(self.output_uri, ONNX_NAME),
            "parity_uri": parity_uri,
            "max_abs_diff": self.number_or_none(parity["max_abs_diff"], "max_abs_diff", parity_uri),
            "argmax_mismatches": self.number_or_none(
                parity["argmax_mismatches"], "argmax_mismatches", parity_uri
            ),
            "passed": bool(parity["passed"]),
        }
        if self.require_parity and not result["passed"]:
            raise HorovodTrainingError(f"ONNX parity check failed: {parity}")
        self.log.info("export: %s", result)
        return result
