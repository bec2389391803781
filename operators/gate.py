"""``ModelGateOperator``: the champion/challenger gate, and the skip of what follows a failure.

Runs in the Airflow worker; needs no torch (re-scoring a champion uses onnxruntime). The
decision is :func:`horovod_airflow.operators.model_registry.gate_challenger`'s; this module only
wires it to
Airflow: templated settings, the connection's S3 client, the XCom, and the skip.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from airflow.providers.standard.utils.skipmixin import SkipMixin
from airflow.sdk import BaseOperator

from horovod_airflow.operators.alerts import check_staleness, notify, staleness
from horovod_airflow.operators.connection import AwsConnectionMixin
from horovod_airflow.operators.exceptions import HorovodConfigError
from horovod_airflow.operators.job import (
    as_fraction,
    as_int,
    as_mapping,
    check_name,
    check_upstream,
    check_uri,
    is_templated,
)
from horovod_airflow.operators.model_registry import (
    gate_challenger,
    read_latest,
    resolve_champion_scorer,
)
from horovod_airflow.operators.retry import with_retry_policy

if TYPE_CHECKING:
    from airflow.sdk import Context


class ModelGateOperator(AwsConnectionMixin, BaseOperator, SkipMixin):
    """Pass a trained model on only if it beats the floor and the published champion.

    The champion is the model that ``<bucket_uri>/models/<model_name>/latest.json`` names.
    The gate passes when the challenger's accuracy (``metrics[metric_key]``) is at least
    ``min_accuracy`` and not worse than the champion's by more than ``max_regression``, both
    measured on the same dataset content: a champion measured on other data is re-scored on
    this run's test split first, or the gate fails and says why. The first model has no
    champion and is judged by the floor alone. Either way the decision is written to
    ``<metrics["output"]>/gate.json`` and logged; ``latest.json`` is only read.

    Returns (as XCom) the decision dict when the gate passes: ``passed``, ``reason``,
    ``challenger_accuracy``, ``champion_accuracy``, ``champion_version``, ``champion_etag``
    (the ``latest.json`` that :class:`PublishModelOperator` may replace) and the rest of
    :class:`horovod_airflow.operators.model_registry.GateDecision`. When it fails, the task
    succeeds and
    skips its downstream tasks the way Airflow's ``ShortCircuitOperator`` does (same
    ``SkipMixin``, so a cleared downstream task stays skipped), and pushes no return value.

    :param bucket_uri: the registry's bucket, ``s3://bucket`` or a local folder (templated).
    :param model_name: the registry name of the model, e.g. ``mnist_cnn`` (templated).
    :param metrics: the train task's XCom, e.g. ``train.output``: holds ``metric_key`` and
        ``output`` (the run's output URI, where ``gate.json`` goes) (templated).
    :param dataset: the staging task's XCom, e.g. ``stage.output``: ``uri`` and
        ``content_hash`` of the data the challenger was measured on (templated).
    :param min_accuracy: the floor, a fraction in [0, 1] (templated).
    :param max_regression: how much worse than the champion the challenger may be, a
        fraction in [0, 1] (templated).
    :param metric_key: the key of ``metrics`` holding the challenger's accuracy (a fraction,
        higher is better); it is compared with the ``val_accuracy`` of the champion's
        ``latest.json``.
    :param aws_conn_id: the Airflow AWS connection; None: the standard ``AWS_*`` environment.
    :param champion_scorer: re-scores a champion measured on other data on this run's
        dataset: ``"package.module:function"`` or a callable, called as ``f(published,
        dataset_uri, client=...)`` and returning ``{"accuracy": ...}``
        (:func:`horovod_airflow.operators.model_registry.resolve_champion_scorer`; a model's app
        names its own, e.g. MNIST's ``horovod_airflow.apps.mnist:score_published_model``);
        None (the default): no re-scoring, so a champion measured on other data fails the gate.
        A model whose dataset never changes (same content hash) is never re-scored.
    :param min_accuracy_floor: the deployment's floor: a rendered ``min_accuracy`` below it
        fails the task without retry, naming both (whoever may trigger a run may not lower
        the bar below the deployment's). Default 0: none.
    :param max_regression_ceiling: the same for ``max_regression``: a rendered value above it
        fails the task. Default 1: none.
    :param ignore_downstream_trigger_rules: as in ``ShortCircuitOperator``: True (default)
        skips every downstream task; False skips the direct ones and lets the others'
        trigger rules decide.
    :param refused_branch: task ids downstream that run only when the gate refuses (the
        retraining pipeline's ``record_refused``, which skips itself after a pass): a refusal
        skips every other downstream task except those the branch needs (its upstream, e.g.
        the export). Empty (default): a refusal skips everything downstream.
    :param on_refused: notifiers (``BaseNotifier``) called when the gate refuses, with the
        task's context plus ``gate`` (the decision: ``reason``, accuracies, champion); e.g.
        :func:`horovod_airflow.operators.alerts.alert_notifiers` ``("refused", ...)``.
    :param stale_after_runs / stale_after_days: on a refusal, fail the task
        (:class:`StaleModelError`, so the failure alerts fire) when this many runs in a row
        were refused (this one included), or when nothing was published for this many days;
        the refused runs are the ``gate.json`` files of the DAG's run folders (the parent of
        ``metrics["output"]``). None: no such check.
    """

    template_fields: Sequence[str] = (
        "bucket_uri",
        "model_name",
        "metrics",
        "dataset",
        "min_accuracy",
        "max_regression",
    )
    template_fields_renderers = {"metrics": "json", "dataset": "json"}  # noqa: RUF012
    # Tells the scheduler (NotPreviouslySkippedDep) to honour this task's skip record.
    inherits_from_skipmixin = True
    ui_color = "#fdf2d0"

    def __init__(
        self,
        *,
        bucket_uri: str,
        model_name: str,
        metrics: Any,
        dataset: Any,
        min_accuracy: float | str,
        max_regression: float | str = 0.0,
        metric_key: str = "val_accuracy",
        aws_conn_id: str | None = "aws_default",
        ignore_downstream_trigger_rules: bool = True,
        champion_scorer: str | Callable[..., dict[str, Any]] | None = None,
        min_accuracy_floor: float = 0.0,
        max_regression_ceiling: float = 1.0,
        on_refused: Sequence[Any] = (),
        stale_after_runs: int | None = None,
        stale_after_days: float | None = None,
        refused_branch: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(**with_retry_policy(kwargs))
        if isinstance(refused_branch, str) or not all(
            isinstance(t, str) and t for t in refused_branch
        ):
            raise ValueError(f"refused_branch must be a list of task ids, got {refused_branch!r}")
        self.refused_branch = tuple(refused_branch)
        self.on_refused = list(on_refused)
        if stale_after_runs is not None:
            stale_after_runs = as_int(stale_after_runs, "stale_after_runs", minimum=1)
        if stale_after_days is not None and (
            isinstance(stale_after_days, bool)
            or not isinstance(stale_after_days, int | float)
            or stale_after_days <= 0
        ):
            raise ValueError(f"stale_after_days must be days > 0 or None, got {stale_after_days!r}")
        self.stale_after_runs = stale_after_runs
        self.stale_after_days = stale_after_days
        self.min_accuracy_floor = as_fraction(min_accuracy_floor, "min_accuracy_floor")
        self.max_regression_ceiling = as_fraction(max_regression_ceiling, "max_regression_ceiling")
        if not isinstance(champion_scorer, str) or champion_scorer.count(":") != 1:
            # a callable or None passes; a bad value raises. A path is imported in execute.
            resolve_champion_scorer(champion_scorer)
        check_uri(bucket_uri, "bucket_uri")
        if not is_templated(model_name):
            check_name(model_name, "model_name")
        if not metric_key or not isinstance(metric_key, str):
            raise ValueError(f"metric_key must be a non-empty string, got {metric_key!r}")
        check_upstream(metrics, "metrics", (metric_key, "output"))
        check_upstream(dataset, "dataset", ("uri",))
        for field, value in (("min_accuracy", min_accuracy), ("max_regression", max_regression)):
            if not is_templated(value):
                as_fraction(value, field)
        self._check_bounds(min_accuracy, max_regression)
        self.bucket_uri = bucket_uri
        self.model_name = model_name
        self.metrics = metrics
        self.dataset = dataset
        self.min_accuracy = min_accuracy
        self.max_regression = max_regression
        self.metric_key = metric_key
        self.aws_conn_id = aws_conn_id
        self.ignore_downstream_trigger_rules = ignore_downstream_trigger_rules
        self.champion_scorer = champion_scorer

    def execute(self, context: Context) -> dict[str, Any] | None:
        try:
            settings = self._rendered_settings()
            scorer = resolve_champion_scorer(self.champion_scorer)
        except ValueError as e:
            raise HorovodConfigError(f"{self.task_id}: {e}") from e
        metrics: Mapping[str, Any] = settings["metrics"]
        decision = gate_challenger(
            **settings,
            metric_key=self.metric_key,
            client=self.s3_client_for(self.bucket_uri, metrics["output"]),
            champion_scorer=scorer,
        )
        if decision.passed:
            return decision.as_dict()
        notify(self.on_refused, context, gate=decision.as_dict())
        self._check_staleness(settings, metrics)
        self.skip_downstream(context)
        return None

    def _check_staleness(self, settings: Mapping[str, Any], metrics: Mapping[str, Any]) -> None:
        """After a refusal: raise :class:`StaleModelError` past either staleness limit."""
        if self.stale_after_runs is None and self.stale_after_days is None:
            return
        from horovod_airflow.core import storage

        client = self.s3_client_for(self.bucket_uri, metrics["output"])
        champion, _ = read_latest(settings["bucket_uri"], settings["model_name"], client=client)
        runs_prefix = str(metrics["output"]).rstrip("/").rsplit("/", 1)[0]
        state = staleness(storage.join(runs_prefix), champion, client=client)
        self.log.info(
            "since the champion: %d refused run(s), %s day(s)",
            state.refused_runs,
            "—" if state.days is None else f"{state.days:.1f}",
        )
        check_staleness(
            state,
            max_refused_runs=self.stale_after_runs or 10**9,
            max_days=self.stale_after_days or float("inf"),
        )

    def _rendered_settings(self) -> dict[str, Any]:
        """The rendered fields, validated, as :func:`gate_challenger`'s keyword arguments."""
        settings = {
            "bucket_uri": check_uri(self.bucket_uri, "bucket_uri"),
            "model_name": check_name(self.model_name, "model_name"),
            "metrics": dict(as_mapping(self.metrics, "metrics", (self.metric_key, "output"))),
            "dataset": dict(as_mapping(self.dataset, "dataset", ("uri",))),
            "min_accuracy": as_fraction(self.min_accuracy, "min_accuracy"),
            "max_regression": as_fraction(self.max_regression, "max_regression"),
        }
        self._check_bounds(settings["min_accuracy"], settings["max_regression"])
        return settings

    def _check_bounds(self, min_accuracy: Any, max_regression: Any) -> None:
        """ValueError when a (literal or rendered) setting passes the deployment's bound."""
        if not is_templated(min_accuracy) and float(min_accuracy) < self.min_accuracy_floor:
            raise ValueError(
                f"min_accuracy {min_accuracy} is below this deployment's floor "
                f"{self.min_accuracy_floor} (min_accuracy_floor): a run may raise the bar, "
                "not lower it"
            )
        if not is_templated(max_regression) and float(max_regression) > (
            self.max_regression_ceiling
        ):
            raise ValueError(
                f"max_regression {max_regression} is above this deployment's ceiling "
                f"{self.max_regression_ceiling} (max_regression_ceiling)"
            )

    def _branch(self, task: Any) -> tuple[list[Any], set[str]]:
        """The refused branch's tasks, and the ids of what they need downstream of the gate
        (the branch, its upstream), checked against the DAG."""
        downstream = {t.task_id: t for t in task.get_flat_relatives(upstream=False)}
        missing = [t for t in self.refused_branch if t not in downstream]
        if missing:
            raise HorovodConfigError(
                f"{self.task_id}: refused_branch names {missing}, which are not downstream "
                f"of the gate ({sorted(downstream)})"
            )
        branch = [downstream[t] for t in self.refused_branch]
        needed = set(self.refused_branch)
        for t in branch:
            needed |= {u.task_id for u in t.get_flat_relatives(upstream=True)} & downstream.keys()
        return branch, needed

    def skip_downstream(self, context: Context) -> None:
        """Skip what follows, as ``ShortCircuitOperator.execute`` does on a falsy condition
        (all but the refused branch and what it needs)."""
        task = context["task"]
        relatives = (
            task.get_flat_relatives(upstream=False)
            if self.ignore_downstream_trigger_rules
            else task.get_direct_relatives(upstream=False)
        )
        keep = self._branch(task)[1] if self.refused_branch else set()
        to_skip = [t for t in relatives if not t.is_teardown and t.task_id not in keep]
        if not to_skip:
            self.log.info("the gate failed; no downstream tasks to skip")
            return
        self.log.info("the gate failed: skipping %s", sorted(t.task_id for t in to_skip))
        self.skip(ti=context["ti"], tasks=to_skip)  # raises DownstreamTasksSkipped
