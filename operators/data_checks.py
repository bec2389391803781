"""Data checks before training: a staged dataset is compared with the one staged before it.

Runs in the Airflow worker, inside the staging step (:mod:`horovod_airflow.operators.staging`),
before anything is uploaded. The new dataset's manifest (built locally, with the per-file
statistics of ``horovod-airflow/dataset-v2`` / ``fileset-v2``) is compared with the manifest
of the **previous** staged dataset of the same name: the newest ``manifest.json`` under
``<bucket>/datasets/<name>/`` (by its upload time) other than the one being staged.

What is compared, per part (a split of an MNIST-format dataset: its images and labels; a
``.npy`` file of a file set):

- **sample counts**: a part may lose at most ``max_sample_drop`` of its previous samples, and
  a part of the previous dataset may not be missing;
- **class balance**: a class the previous labels held may not be missing, and each class's
  share of the samples may move at most ``max_class_share_change`` (absolute: 0.05 is 5
  points);
- **shapes and dtypes** of one sample: must be the previous ones;
- **duplicates**: at most ``max_duplicate_fraction`` of a part's samples may repeat an earlier
  sample of it. This one needs no previous dataset, so it holds for the first staging too;
- a **user check** (``check="package.module:function"``), called as
  ``f(manifest, previous, files)`` (``previous`` None on a first staging, ``files`` the local
  paths by name) and returning the problems it found (strings; none: it passes).

A change beyond a threshold raises :class:`DataCheckError` naming what changed and by how
much; the operator fails the task without a retry (the same data fails the same way). A
refused dataset is never uploaded, so it never becomes "the previous one" of a later run: the
baseline is always a dataset a staging accepted. A first staging of a name has nothing to
compare with; it passes (the duplicate and user checks still apply) and says so.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from horovod_airflow.core import layout, storage
from horovod_airflow.core.contract import MANIFEST_NAME
from horovod_airflow.operators.import_path import check_import_path, import_callable

log = logging.getLogger(__name__)

#: A part's dtype when its manifest says none: a dataset-v1 manifest's IDX files are ubyte.
IDX_DTYPE = "uint8"


class DataCheckError(layout.DatasetError):
    """The staged dataset changed beyond the declared thresholds against the previous one
    (each problem in ``problems``). Nothing was uploaded."""

    def __init__(self, message: str, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__(message)


def _fraction(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"DataChecks.{name} must be a number from 0 to 1, got {value!r}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"DataChecks.{name} must be from 0 to 1, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DataChecks:
    """The thresholds of the data checks (see the module's docstring), declared once per DAG.

    Not templated on purpose: whoever triggers a run must not loosen the bar the deployment
    set for its data (like the gate's floors, ``HVA_MIN_ACCURACY_FLOOR``).
    """

    #: A split (or .npy file) may lose at most this fraction of its previous samples.
    max_sample_drop: float = 0.5
    #: A class's share of a split's samples may move at most this much (0.05: 5 points).
    max_class_share_change: float = 0.05
    #: At most this fraction of a split's samples may repeat an earlier sample of it.
    max_duplicate_fraction: float = 0.05
    #: File sets only: the .npy files holding class labels (1-D integers), balance-checked.
    class_labels: tuple[str, ...] = ()
    #: A user check, ``"package.module:function"``; see the module's docstring. None: none.
    check: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_sample_drop", "max_class_share_change", "max_duplicate_fraction"):
            object.__setattr__(self, name, _fraction(name, getattr(self, name)))
        labels = self.class_labels
        if isinstance(labels, str) or not all(
            isinstance(n, str) and n and "/" not in n for n in labels
        ):
            raise ValueError(
                f"DataChecks.class_labels must be a list of file names of the file set, "
                f"got {labels!r}"
            )
        object.__setattr__(self, "class_labels", tuple(labels))
        if self.check is not None:
            check_import_path(self.check, "DataChecks.check")

    def user_check(self) -> Callable[..., Any] | None:
        """The user check's function, imported; ValueError naming the path if it is not one."""
        if self.check is None:
            return None
        return import_callable(self.check, "DataChecks.check")


@dataclass(frozen=True)
class Part:
    """What the checks compare of one split (or one .npy file of a file set)."""

    samples: int
    sample_shape: tuple[int, ...] | None
    dtype: str | None
    duplicates: int | None
    classes: dict[str, int] | None


def parts(manifest: Mapping[str, Any]) -> dict[str, Part]:
    """The comparable parts of a dataset manifest (splits) or a file-set manifest (.npy files
    with statistics); fields a manifest lacks (a v1 one) are None."""
    if manifest.get("splits") is not None:  # an MNIST-format dataset
        out = {}
        for split in sorted(manifest["splits"]):
            images = layout.entry_for(dict(manifest), split, "images")
            labels = layout.entry_for(dict(manifest), split, "labels")
            shape = images.get("shape")
            out[split] = Part(
                samples=int(images["samples"]),
                sample_shape=tuple(shape[1:]) if shape else None,
                dtype=images.get("dtype", IDX_DTYPE),
                duplicates=images.get("duplicates"),
                classes=labels.get("classes"),
            )
        return out
    out = {}
    for entry in manifest["files"]:
        if "samples" in entry:
            shape = entry.get("shape")
            out[entry["name"]] = Part(
                samples=int(entry["samples"]),
                sample_shape=tuple(shape[1:]) if shape else None,
                dtype=entry.get("dtype"),
                duplicates=entry.get("duplicates"),
                classes=entry.get("classes"),
            )
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _limit(x: float) -> str:
    return f"{100 * x:g} %"


def compare(
    manifest: Mapping[str, Any], previous: Mapping[str, Any] | None, checks: DataChecks
) -> list[str]:
    """The problems of ``manifest`` against ``previous`` (None: a first staging) under
    ``checks``; empty when it passes. The user check is not run here (see :func:`run_checks`)."""
    now = parts(manifest)
    problems = []
    for name, part in now.items():
        if part.duplicates is not None and part.samples:
            share = part.duplicates / part.samples
            if share > checks.max_duplicate_fraction:
                problems.append(
                    f"{name}: {part.duplicates} of {part.samples} samples ({_pct(share)}) repeat "
                    f"an earlier sample (allowed {_limit(checks.max_duplicate_fraction)})"
                )
    if previous is None:
        return problems
    for name, before in parts(previous).items():
        if name not in now:
            problems.append(f"{name}: missing (previously {before.samples} samples)")
            continue
        part = now[name]
        if before.samples:
            change = (part.samples - before.samples) / before.samples
            if -change > checks.max_sample_drop:
                problems.append(
                    f"{name}: {part.samples} samples, previously {before.samples} "
                    f"({100 * change:+.1f} %, allowed -{_limit(checks.max_sample_drop)})"
                )
        if None not in (part.sample_shape, before.sample_shape) and (
            part.sample_shape != before.sample_shape
        ):
            problems.append(
                f"{name}: samples shaped {list(part.sample_shape or ())}, previously "
                f"{list(before.sample_shape or ())}"
            )
        if None not in (part.dtype, before.dtype) and part.dtype != before.dtype:
            problems.append(f"{name}: dtype {part.dtype}, previously {before.dtype}")
        if part.classes is not None and before.classes is not None:
            problems.extend(_class_balance(name, part, before, checks))
    return problems


def _class_balance(name: str, part: Part, before: Part, checks: DataChecks) -> list[str]:
    assert part.classes is not None and before.classes is not None
    total_now = sum(part.classes.values()) or 1
    total_before = sum(before.classes.values()) or 1
    problems = []
    for label in sorted({*part.classes, *before.classes}, key=_label_order):
        had, has = before.classes.get(label, 0), part.classes.get(label, 0)
        if had and not has:
            problems.append(
                f"class {label} missing from {name} (previously {had} samples, "
                f"{_pct(had / total_before)})"
            )
            continue
        change = has / total_now - had / total_before
        if abs(change) > checks.max_class_share_change:
            problems.append(
                f"{name}: class {label} is {_pct(has / total_now)} of the samples, previously "
                f"{_pct(had / total_before)} ({100 * change:+.1f} points, allowed "
                f"±{100 * checks.max_class_share_change:g} points)"
            )
    return problems


def _label_order(label: str) -> tuple[int, int | str]:
    return (0, int(label)) if label.lstrip("-").isdigit() else (1, label)


@dataclass(frozen=True)
class Previous:
    """The previous staged dataset of a name: its prefix, manifest and upload time."""

    uri: str
    manifest: dict[str, Any]
    staged_at: str


def previous_staged(
    bucket_uri: str,
    name: str,
    *,
    exclude: str,
    parse: Callable[[bytes], dict[str, Any]],
    client: Any | None = None,
) -> Previous | None:
    """The newest staged manifest under ``<bucket_uri>/datasets/<name>/`` other than the one
    at ``exclude`` (the prefix being staged), that ``parse`` reads (one of this kind:
    MNIST-format or file set); None when there is none. A prefix without a manifest is an
    upload that never finished and is not a candidate; an unreadable manifest is logged and
    passed over."""
    root = f"{layout.datasets_root(bucket_uri)}/{name}"
    loc = storage.parse(root)
    # list_objects names S3 objects by URI and local files by path (no file:// scheme)
    listed_root = f"s3://{loc.bucket}/{loc.key}" if loc.is_s3 else loc.key
    excluded = exclude.rstrip("/").rsplit("/", 1)[-1]
    found = []
    for obj in storage.list_objects(root, client=client):
        if not obj.uri.startswith(listed_root.rstrip("/") + "/"):
            continue
        segments = obj.uri[len(listed_root.rstrip("/")) + 1 :].split("/")
        if len(segments) == 2 and segments[1] == MANIFEST_NAME and segments[0] != excluded:
            found.append((obj.modified, obj.uri, f"{root}/{segments[0]}"))
    for modified, uri, prefix in sorted(found, reverse=True):
        try:
            manifest = parse(storage.read_bytes(uri, client=client))
        except layout.DatasetError as e:
            log.warning("data checks: passing over %s: %s", uri, e)
            continue
        return Previous(prefix, manifest, modified.isoformat())
    return None


def run_checks(
    manifest: Mapping[str, Any],
    previous: Previous | None,
    checks: DataChecks,
    files: Mapping[str, Path],
    *,
    staged_uri: str,
) -> dict[str, Any]:
    """Run the checks; raise :class:`DataCheckError` naming every problem, else return the
    report for the XCom: ``{"previous", "previous_staged_at", "passed": True}``."""
    problems = compare(manifest, previous.manifest if previous else None, checks)
    user = checks.user_check()
    if user is not None:
        found = user(dict(manifest), dict(previous.manifest) if previous else None, dict(files))
        if isinstance(found, str) or not all(isinstance(p, str) for p in found or ()):
            raise TypeError(
                f"DataChecks.check {checks.check!r} must return a list of problems (strings), "
                f"got {found!r}"
            )
        problems.extend(f"{checks.check}: {p}" for p in found or ())
    name = manifest["name"]
    against = (
        f"against {previous.uri} (staged {previous.staged_at})"
        if previous
        else "with nothing to compare against (the first staging of this name)"
    )
    if problems:
        raise DataCheckError(
            f"dataset {name!r} refused by its data checks {against}: "
            + "; ".join(problems)
            + f". Nothing was staged at {staged_uri}. If the change is intended, loosen the "
            "DAG's DataChecks (HVA_DATA_* settings) for it",
            problems,
        )
    if previous is None:
        log.info(
            "data checks: %s is the first staged dataset named %r: nothing to compare with "
            "(only the duplicate%s ran)",
            staged_uri, name, " and user checks" if user else " check",
        )  # fmt: skip
    else:
        log.info("data checks: %s passed %s", staged_uri, against)
    return {
        "passed": True,
        "previous": previous.uri if previous else None,
        "previous_staged_at": previous.staged_at if previous else None,
    }
