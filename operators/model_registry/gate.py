"""The champion/challenger gate: compare like with like (the champion re-scored on the
challenger's dataset when it was measured on other data), decide, write ``gate.json``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from horovod_airflow.core import storage
from horovod_airflow.core.contract import (
    GATE,
    GATE_NAME,
    LATEST_NAME,
)
from horovod_airflow.operators.import_path import import_callable
from horovod_airflow.operators.model_registry.latest import read_latest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateDecision:
    """The outcome of the champion/challenger gate, with both numbers and the reason.

    ``champion_accuracy`` is the number the challenger was compared with: the champion's
    stored accuracy when both were measured on the same dataset content, else its accuracy
    re-scored on the challenger's dataset (``champion_rescored``), else None (refused).
    ``champion_etag`` is the ETag of the ``latest.json`` the gate read; publish writes only
    over that one.
    """

    passed: bool
    reason: str
    challenger_accuracy: float
    min_accuracy: float
    champion_accuracy: float | None
    champion_version: str | None
    max_regression: float
    challenger_dataset_hash: str | None = None
    champion_dataset_hash: str | None = None
    champion_stored_accuracy: float | None = None
    champion_rescored: bool = False
    champion_etag: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def champion_dataset_hash(champion: dict | None) -> str | None:
    """The dataset content hash the champion was measured on (None: not recorded)."""
    if champion is None:
        return None
    value = champion.get("dataset_content_hash")
    return str(value) if value else None


def decide_gate(
    challenger_accuracy: float,
    *,
    min_accuracy: float,
    champion: dict | None,
    max_regression: float,
    challenger_dataset_hash: str | None = None,
    champion_rescored_accuracy: float | None = None,
    champion_etag: str | None = None,
) -> GateDecision:
    """Pass when accuracy >= min_accuracy and is not worse than the champion by > max_regression.

    Accuracies are fractions in [0, 1]. The first model has no champion and is judged by the
    floor alone. The champion's stored accuracy counts only when it was measured on the same
    dataset content (``challenger_dataset_hash``); otherwise the gate uses
    ``champion_rescored_accuracy`` (the champion scored on the challenger's dataset) and,
    without it, refuses: accuracies on different data are not comparable.
    """
    for name, value in (
        ("challenger_accuracy", challenger_accuracy),
        ("min_accuracy", min_accuracy),
        ("max_regression", max_regression),
    ):
        if not 0.0 <= float(value) <= 1.0:
            raise ValueError(f"{name} must be a fraction in [0, 1], got {value!r}")
    stored = None if champion is None else float(champion["val_accuracy"])
    champ_ver = None if champion is None else str(champion.get("version"))
    champ_hash = champion_dataset_hash(champion)
    same_data = champion is None or (
        challenger_dataset_hash is not None and champ_hash == challenger_dataset_hash
    )
    champ_acc: float | None = None
    rescored = False
    if same_data:
        champ_acc = stored
    elif champion_rescored_accuracy is not None:
        champ_acc, rescored = float(champion_rescored_accuracy), True

    def decision(passed: bool, reason: str) -> GateDecision:
        return GateDecision(
            passed=passed,
            reason=reason,
            challenger_accuracy=float(challenger_accuracy),
            min_accuracy=float(min_accuracy),
            champion_accuracy=champ_acc,
            champion_version=champ_ver,
            max_regression=float(max_regression),
            challenger_dataset_hash=challenger_dataset_hash,
            champion_dataset_hash=champ_hash,
            champion_stored_accuracy=stored,
            champion_rescored=rescored,
            champion_etag=champion_etag,
        )

    if challenger_accuracy < min_accuracy:
        return decision(
            False,
            f"accuracy {challenger_accuracy:.4%} is below the floor min_accuracy "
            f"{min_accuracy:.4%}",
        )
    if champion is None or champ_acc is None:
        if champion is not None:
            return decision(
                False,
                f"the champion {champ_ver} was measured on dataset {_short(champ_hash)}, this "
                f"model on {_short(challenger_dataset_hash)}: accuracies on different data are "
                f"not comparable, and the champion was not re-scored on this dataset",
            )
        return decision(
            True, f"accuracy {challenger_accuracy:.4%} >= floor {min_accuracy:.4%}; no champion yet"
        )
    basis = (
        f"re-scored on this run's dataset {_short(challenger_dataset_hash)}; it was measured "
        f"at {stored:.4%} on {_short(champ_hash)}"
        if rescored
        else f"measured on the same dataset {_short(champ_hash)}"
    )
    if challenger_accuracy < champ_acc - max_regression:
        return decision(
            False,
            f"accuracy {challenger_accuracy:.4%} is worse than the champion {champ_ver} "
            f"({champ_acc:.4%}, {basis}) by more than max_regression {max_regression:.4%}",
        )
    return decision(
        True,
        f"accuracy {challenger_accuracy:.4%} >= floor {min_accuracy:.4%}; champion {champ_ver} "
        f"has {champ_acc:.4%}, {basis} (max_regression {max_regression:.4%})",
    )


def _short(content_hash: str | None) -> str:
    return "unknown (not recorded)" if not content_hash else content_hash[:16]


def resolve_champion_scorer(
    scorer: str | Callable[..., dict[str, Any]] | None,
) -> Callable[..., dict[str, Any]] | None:
    """The function that re-scores a champion on another dataset, or None (no re-scoring).

    ``scorer`` is a callable or its import path ``"package.module:function"`` (a string keeps
    an operator's settings serializable). It is called as ``scorer(published, dataset_uri,
    client=client)`` — ``published`` the champion's ``latest.json``, ``dataset_uri`` the
    staged dataset of this run — and returns a dict with ``accuracy`` (a fraction in [0, 1],
    the champion's on that dataset), like
    :func:`horovod_airflow.apps.mnist.score_published_model` (MNIST's).
    Raises ValueError naming a path that does not import or name a callable.
    """
    if scorer is None or callable(scorer):
        return scorer
    if not isinstance(scorer, str):
        raise ValueError(
            f"champion_scorer must be a callable, None, or 'package.module:function', "
            f"got {scorer!r}"
        )
    return import_callable(scorer, "champion_scorer")


def gate_challenger(
    *,
    bucket_uri: str,
    model_name: str,
    metrics: dict[str, Any],
    dataset: dict[str, Any],
    min_accuracy: float,
    max_regression: float,
    metric_key: str = "val_accuracy",
    client: Any | None = None,
    champion_scorer: str | Callable[..., dict[str, Any]] | None = None,
) -> GateDecision:
    """The gate task: read the champion, compare like with like, write ``gate.json``.

    ``metrics`` is the train task's XCom (``metric_key``, default ``val_accuracy``, and
    ``output``), ``dataset`` the staging task's (``uri``, ``content_hash``). The champion's
    number is the ``val_accuracy`` its ``latest.json`` records (or its accuracy re-scored on
    this dataset), so ``metric_key`` must name the challenger's accuracy, a fraction in
    [0, 1]. When the champion was measured on other data
    (or its dataset is not recorded), it is re-scored on this dataset first by
    ``champion_scorer`` (see :func:`resolve_champion_scorer`; the model's own, e.g. MNIST's
    onnxruntime on the staged test split); if that fails, or ``champion_scorer`` is None,
    the decision refuses and says why — except where the store did not answer
    (:class:`~horovod_airflow.core.storage.TransientStorageError`, raised: the task fails
    and is retried, since a refusal would skip publishing for a blip).
    """
    champion, etag = read_latest(bucket_uri, model_name, client=client)
    challenger_hash = dataset.get("content_hash")
    rescored = None
    if champion is not None and champion_dataset_hash(champion) != challenger_hash:
        from horovod_airflow.operators.serving import ModelIntegrityError, in_registry

        # the champion is loaded from the registry's own locations, whatever latest.json
        # says: a record pointing elsewhere fails the task (ModelIntegrityError), loudly
        champion = in_registry(bucket_uri, model_name, champion, LATEST_NAME)
        scorer = resolve_champion_scorer(champion_scorer)
        if scorer is None:
            log.warning(
                "no champion_scorer: the champion %s is not re-scored", champion.get("version")
            )
        else:
            try:
                rescored = float(scorer(champion, dataset["uri"], client=client)["accuracy"])
            except storage.TransientStorageError:
                # the store did not answer: no verdict on the champion; fail, so a retry asks
                # again, rather than refuse the challenger and skip this week's publish
                raise
            except (ModelIntegrityError, storage.StorageError, ValueError, KeyError) as e:
                # DatasetError is a ValueError; so is a model the scorer cannot read
                log.warning("cannot re-score the champion %s: %s", champion.get("version"), e)
    decision = decide_gate(
        metrics[metric_key],
        min_accuracy=min_accuracy,
        champion=champion,
        max_regression=max_regression,
        challenger_dataset_hash=challenger_hash,
        champion_rescored_accuracy=rescored,
        champion_etag=etag,
    )
    storage.write_text(
        storage.join(metrics["output"], GATE_NAME),
        GATE.dumps(decision.as_dict()),
        client=client,
    )
    log.info("gate %s: %s", "PASSED" if decision.passed else "FAILED", decision.reason)
    return decision
