"""``HorovodTrainOperator``: run a Horovod training program and return its metrics.

Runs in the Airflow worker; the training itself runs in the ranks ``horovodrun`` starts
(on the worker, in a container, or in a Kubeflow MPIJob). Never imports torch or horovod.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from horovod_airflow.core.contract import (
    CHECKPOINT_NAME,
    METRICS,
    METRICS_NAME,
    elastic_summary,
)
from horovod_airflow.operators.command import (
    TRAINER_ENTRYPOINT,
    check_controller,
    doctor_argv,
    is_our_train,
    is_our_trainer,
    program_argv,
    trainer_args_to_argv,
)
from horovod_airflow.operators.exceptions import (
    HorovodConfigError,
    HorovodTrainingError,
    TrainingCompletedError,
)
from horovod_airflow.operators.job import HorovodJobOperatorBase, as_int, is_templated
from horovod_airflow.operators.launchers.base import ElasticSpec, JobSpec
from horovod_airflow.operators.launchers.local_options import ElasticOptions
from horovod_airflow.operators.links import RunFolderLink

if TYPE_CHECKING:
    from airflow.sdk import Context

XCOM_KEYS = ("val_accuracy", "val_loss", "val_samples", "epochs", "world_size")


def _same_setting(recorded: Any, given: Any) -> bool:
    """A recorded setting equals the one given, as the command line would pass it."""
    if recorded == given:
        return True
    try:
        return float(recorded) == float(given)
    except (TypeError, ValueError):
        return str(recorded) == str(given)


class HorovodTrainOperator(HorovodJobOperatorBase):
    """Train with Horovod on ``num_proc`` ranks; return the metrics the program wrote.

    Builds ``horovodrun --gloo -np N -H hosts <entrypoint> --data D --output O [trainer_args]``
    (``--resume`` added on Airflow retries when ``resume_on_retry``), runs it through the
    chosen launcher, then reads ``<output>/metrics.json`` with the AWS connection and
    returns (as XCom) ``val_accuracy, val_loss, val_samples, epochs, world_size, output,
    metrics_uri, checkpoint_uri`` (and ``metric_key``'s value; for an elastic run also
    ``elastic``: :func:`horovod_airflow.core.contract.elastic_summary`). Any program that follows
    the training-program contract of ``docs/design.md`` can be the ``entrypoint``.

    :param num_proc: number of Horovod ranks (templated; validated after rendering).
    :param data: dataset URI handed as ``--data`` (templated).
    :param output: output URI handed as ``--output``; metrics.json is read from it
        (templated, as the ``output_uri`` attribute: ``BaseOperator.output`` is the XComArg).
    :param trainer_args: extra program arguments: a dict (``batch_size=64`` → ``--batch-size
        64``; True → bare flag; False/None → omitted) or a list of strings (templated).
    :param entrypoint: the program, default ``python -m horovod_airflow.trainer train``.
    :param metric_key: the gate metric that must be in metrics.json.
    :param resume_on_retry: add ``--resume`` on a later try (``try_number > 1``) of a run
        whose training did not complete, so a failed try continues from its checkpoint.

    A later try that finds ``<output>/metrics.json`` returns that completed training instead
    of training again, once it is shown to be this task's: its ``world_size``, dataset URI
    and the settings of ``trainer_args`` (where metrics.json records them) equal this try's.
    So a try whose job finished but whose clean-up, result read or XCom push failed (a
    deleted job's 500, a lost worker) costs no second training, and a person's Clear of a
    successful train returns the same model. A metrics.json that is not this task's (or not
    readable as one) raises :class:`TrainingCompletedError`: it is neither reused nor
    overwritten; trigger a new DAG run to train again. Settings that are invalid once
    rendered raise :class:`HorovodConfigError`; both fail without retrying.
    :param controller: horovodrun's controller, ``"gloo"`` (default: what this project's
        Horovod builds have), ``"mpi"`` (a Horovod built with MPI; needed for Adasum) or
        ``"auto"`` (horovodrun probes the build and prefers MPI; the probe costs seconds).
    :param elastic: :class:`~horovod_airflow.operators.launchers.local_options.ElasticOptions`
        (its ``min_np`` and ``max_np`` are rendered (templated)): elastic Horovod, ranks of a
        lost host leave and a new host's join without failing the task; adds ``--elastic``
        to our trainer. ``launcher="local"`` over several hosts, or ``launcher="kubernetes"``
        with an MPIJob; refused elsewhere, naming why. A completed
        elastic training is this task's whatever world size it ended at.

    Plus the settings of :class:`horovod_airflow.operators.job.HorovodJobOperatorBase`:
    ``launcher``, its
    options objects (hosts and horovodrun's ssh settings are
    :class:`~horovod_airflow.operators.launchers.local.LocalOptions`), and the timeout rule
    (``execution_timeout``).
    """

    template_fields: Sequence[str] = (
        "launcher",
        "data",
        "output_uri",
        "trainer_args",
        "env",
        "image",
        "num_proc",
        "elastic",
    )
    template_fields_renderers = {"env": "json", "trainer_args": "json"}  # noqa: RUF012
    operator_extra_links = (RunFolderLink(),)

    def __init__(
        self,
        *,
        data: str,
        output: str,
        num_proc: int | str = 1,
        entrypoint: Sequence[str] = TRAINER_ENTRYPOINT,
        trainer_args: Mapping[str, Any] | Sequence[str] | None = None,
        metric_key: str = "val_accuracy",
        resume_on_retry: bool = True,
        controller: str = "gloo",
        elastic: ElasticOptions | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if elastic is not None and not isinstance(elastic, ElasticOptions):
            raise ValueError(f"elastic must be an ElasticOptions or None, got {elastic!r}")
        if not is_templated(num_proc):
            as_int(num_proc, "num_proc", minimum=1)
        if not data or not isinstance(data, str):
            raise ValueError(f"data must be a dataset URI (s3://... or a path), got {data!r}")
        if not output or not isinstance(output, str):
            raise ValueError(f"output must be an output URI (s3://... or a path), got {output!r}")
        if (
            isinstance(entrypoint, str)
            or not entrypoint
            or not all(isinstance(a, str) and a for a in entrypoint)
        ):
            raise ValueError(
                f"entrypoint must be a non-empty list of strings like "
                f"['python', '-m', 'horovod_airflow.trainer', 'train'], got {entrypoint!r}"
            )
        if isinstance(trainer_args, Mapping) or (
            trainer_args is not None and not is_templated(trainer_args)
        ):
            # keys are never templated: a misspelt option of our trainer fails at parse time
            trainer_args_to_argv(trainer_args, entrypoint)  # raises ValueError naming the key
        if not metric_key or not isinstance(metric_key, str):
            raise ValueError(f"metric_key must be a non-empty string, got {metric_key!r}")
        check_controller(controller)
        self.data = data
        self.output_uri = output
        self.num_proc = num_proc
        self.entrypoint = tuple(entrypoint)
        self.trainer_args = trainer_args
        self.metric_key = metric_key
        self.resume_on_retry = resume_on_retry
        self.controller = controller
        self.elastic = elastic

    def build_spec(self, context: Context) -> JobSpec:
        """Validate the rendered fields and build the job (command, env, secrets).

        Raises :class:`HorovodConfigError` naming a bad setting, and
        :class:`TrainingCompletedError` on a later try of a completed training.
        """
        try:
            return self._build_spec(context)
        except ValueError as e:
            if isinstance(e, HorovodConfigError):
                raise
            raise HorovodConfigError(f"{self.task_id}: {e}") from e

    def refuse_completed_training(self, try_number: int) -> None:
        """On a later try, raise :class:`TrainingCompletedError` if metrics.json is there
        (``execute`` returns a completed training of this task before it builds a job)."""
        from horovod_airflow.core import storage

        metrics_uri = storage.join(self.output_uri, METRICS_NAME)
        if storage.exists(metrics_uri, client=self.s3_client_for(metrics_uri)):
            raise TrainingCompletedError(
                f"try {try_number}: the training of this run already completed "
                f"({metrics_uri} exists); it is neither resumed nor redone over that model. "
                f"Trigger a new DAG run to train again (it gets its own output prefix)."
            )

    def completed_result(self, context: Context) -> dict[str, Any] | None:
        """On a later try: the result of this task's training that an earlier try completed,
        or None when none did (then this try trains, resuming where allowed).

        Raises :class:`TrainingCompletedError` when ``<output>/metrics.json`` exists but is
        not this task's: unreadable, or recording another world size, dataset or setting.
        """
        from horovod_airflow.core import storage

        ti = context.get("ti")
        try_number = int(getattr(ti, "try_number", 1) or 1)
        metrics_uri = storage.join(self.output_uri, METRICS_NAME)
        if try_number <= 1 or not storage.exists(
            metrics_uri, client=self.s3_client_for(metrics_uri)
        ):
            return None
        try:
            num_proc = as_int(self.num_proc, "num_proc", minimum=1)
            metrics = self.read_json(metrics_uri, METRICS_NAME, METRICS)
        except (ValueError, HorovodTrainingError) as e:
            raise TrainingCompletedError(
                f"try {try_number}: {metrics_uri} exists but cannot be checked as this task's "
                f"training ({e}); it is neither reused nor overwritten. Trigger a new DAG run."
            ) from e
        differ = self._differences(metrics, num_proc)
        if differ:
            raise TrainingCompletedError(
                f"try {try_number}: {metrics_uri} holds a completed training that is not this "
                f"task's ({'; '.join(differ)}); it is neither reused nor overwritten. "
                f"Trigger a new DAG run to train again (it gets its own output prefix)."
            )
        self.log.info(
            "try %d: an earlier try completed this training (%s): returning its result, "
            "not training again",
            try_number,
            metrics_uri,
        )
        return self.collect_result()

    def _differences(self, metrics: Mapping[str, Any], num_proc: int) -> list[str]:
        """What ``metrics`` records that differs from this try's settings."""
        differ = []
        if self.elastic is None and metrics.get("world_size") not in (None, num_proc):
            differ.append(f"world_size: recorded {metrics['world_size']}, now {num_proc}")
        dataset = metrics.get("dataset")
        if isinstance(dataset, Mapping) and dataset.get("uri") not in (None, self.data):
            differ.append(f"dataset: recorded {dataset['uri']}, now {self.data}")
        config = metrics.get("config")
        if isinstance(config, Mapping) and isinstance(self.trainer_args, Mapping):
            for key, value in self.trainer_args.items():
                if value is None or value is False or key not in config:
                    continue  # not passed on the command line, or not recorded
                if not _same_setting(config[key], value):
                    differ.append(f"{key}: recorded {config[key]!r}, now {value!r}")
        return differ

    def _build_spec(self, context: Context) -> JobSpec:
        self.check_launcher_settings()
        num_proc = as_int(self.num_proc, "num_proc", minimum=1)
        ti = context.get("ti")
        try_number = int(getattr(ti, "try_number", 1) or 1)
        if try_number > 1:
            # execute returned a completed training of this task already; one that appeared
            # since it looked (or reached by build_spec alone) is never overwritten
            self.refuse_completed_training(try_number)
        resume = self.resume_on_retry and try_number > 1  # a failed try of this same run
        program = program_argv(
            self.entrypoint,
            data=self.data,
            output=self.output_uri,
            extra=trainer_args_to_argv(self.trainer_args, self.entrypoint),
            resume=resume,
        )
        elastic = None
        if self.elastic is not None:
            e = self.elastic
            elastic = ElasticSpec(
                as_int(e.min_np, "elastic.min_np", minimum=1),
                as_int(e.max_np, "elastic.max_np", minimum=1),
                e.timeout_s,
                e.hosts_file,
                e.cooldown_s,
            )
            if is_our_train(self.entrypoint) and "--elastic" not in program:
                program.append("--elastic")
        if resume:
            self.log.info("try %d: resuming from the checkpoint in %s", try_number, self.output_uri)
        public, secret = self.job_env()
        name, labels = self.job_identity(context)
        preflight = (
            doctor_argv(self.entrypoint, num_proc, self.gpus_per_proc)
            if is_our_trainer(self.entrypoint)
            else None
        )
        # The program and its ranks; each launcher builds horovodrun (-H, ssh, controller),
        # the container or the manifest around it.
        return JobSpec(
            name=name,
            argv=program,
            env=public,
            secret_env=secret,
            num_proc=num_proc,
            gpus_per_proc=self.gpus_per_proc,
            distributed=True,
            preflight_argv=preflight,
            controller=self.controller,
            labels=labels,
            elastic=elastic,
        )

    def execute(self, context: Context) -> dict[str, Any]:
        self.start_clock()
        done = self.completed_result(context)
        if done is not None:
            return done
        spec = self.build_spec(context)
        self.log.info(
            "launching %d ranks with %s: %s", spec.num_proc, self.launcher, shlex.join(spec.argv)
        )
        self.run_job(spec, context)
        return self.collect_result()

    def collect_result(self) -> dict[str, Any]:
        """Read ``<output>/metrics.json`` (not stdout) and return the small XCom dict."""
        from horovod_airflow.core import storage

        metrics_uri = storage.join(self.output_uri, METRICS_NAME)
        metrics = self.read_json(metrics_uri, METRICS_NAME, METRICS)
        if self.metric_key not in metrics:
            raise HorovodTrainingError(
                f"metrics.json at {metrics_uri} has no {self.metric_key!r} (metric_key); "
                f"keys present: {sorted(metrics)}"
            )
        result: dict[str, Any] = {
            key: self.number_or_none(metrics.get(key), key, metrics_uri) for key in XCOM_KEYS
        }
        result[self.metric_key] = self.number_or_none(
            metrics[self.metric_key], self.metric_key, metrics_uri
        )
        artifacts = metrics.get("artifacts") or {}
        checkpoint = artifacts.get("checkpoint") if isinstance(artifacts, dict) else None
        if checkpoint is None and storage.exists(
            storage.join(self.output_uri, CHECKPOINT_NAME),
            client=self.s3_client_for(self.output_uri),
        ):
            checkpoint = storage.join(self.output_uri, CHECKPOINT_NAME)
        result.update(output=self.output_uri, metrics_uri=metrics_uri, checkpoint_uri=checkpoint)
        elastic = elastic_summary(metrics)
        if elastic is not None:
            result["elastic"] = elastic
            for w in elastic["world_history"]:
                if not w.get("from"):
                    continue  # a (re)start, not a change
                self.log.warning(
                    "world size changed %s -> %s in epoch %s (left: %s; joined: %s)",
                    w.get("from"), w.get("to"), w.get("epoch"),
                    ", ".join(w.get("left") or []) or "none",
                    ", ".join(w.get("joined") or []) or "none",
                )  # fmt: skip
        self.log.info("metrics: %s", result)
        return result

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """OpenLineage (the provider's hook): the staged dataset in, the run folder out."""
        from horovod_airflow.operators.lineage import operator_lineage

        return operator_lineage([str(self.data)], [str(self.output_uri)])
