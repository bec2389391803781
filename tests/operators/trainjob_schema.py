"""Checks a Kubeflow Trainer v2 manifest (``TrainJob``, ``TrainingRuntime``,
``ClusterTrainingRuntime``, ``trainer.kubeflow.org/v1alpha1``) against Trainer's own API
schema: the pydantic models of the ``kubeflow-trainer-api`` package (see SCHEMA_SOURCE.md),
generated from Trainer's OpenAPI spec — Trainer's types, JobSet's and the Kubernetes core and
batch types they embed.

The generated models ignore keys they do not know, and the API server would prune an unknown
field of a CRD's pod template without a word, so parsing alone would let a misspelt field
through. ``trainjob_errors`` therefore walks the manifest alongside the models: at each level
every key must be a property (its JSON alias) of that level's model, every required property
must be there, and every leaf value must validate against the property's type (strict: ``"2"``
is not an integer). Then the whole manifest is parsed with the model's own ``from_dict``.
Problems are returned as ``path: what`` strings (``spec.template.spec.replicatedJobs[0]...``);
an empty list means the manifest is valid.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from kubeflow_trainer_api import models
from pydantic import BaseModel, TypeAdapter, ValidationError

API_VERSION = "trainer.kubeflow.org/v1alpha1"
KINDS: dict[str, type[BaseModel]] = {
    "TrainJob": models.TrainerV1alpha1TrainJob,
    "TrainingRuntime": models.TrainerV1alpha1TrainingRuntime,
    "ClusterTrainingRuntime": models.TrainerV1alpha1ClusterTrainingRuntime,
}


def trainjob_errors(body: Any) -> list[str]:
    """The problems of a Trainer manifest, as ``path: what``; [] when it is valid."""
    if not isinstance(body, dict):
        return [f": must be an object, got {type(body).__name__}"]
    kind = body.get("kind")
    if kind not in KINDS or body.get("apiVersion") != API_VERSION:
        return [
            f"apiVersion/kind: must be {API_VERSION} and one of {', '.join(KINDS)}, "
            f"got {body.get('apiVersion')!r}/{kind!r}"
        ]
    model = KINDS[kind]
    errors: list[str] = []
    _walk(body, model, "", errors)
    if not errors:  # the walk found nothing: the generated parser must agree
        try:
            model.from_dict(body)  # type: ignore[attr-defined]
        except (ValidationError, ValueError) as e:
            errors.append(f"{kind}: {e}")
    return errors


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _is_one_of(model: type[BaseModel]) -> bool:
    """A oneOf wrapper (Quantity, IntOrString): the value is one of several plain types."""
    return "actual_instance" in model.model_fields


def _walk(value: Any, annotation: Any, path: str, errors: list[str]) -> None:
    """Check ``value`` against ``annotation`` (a model class or a typing annotation)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return
        if len(options) == 1:
            _walk(value, options[0], path, errors)
            return
    elif origin is typing.Annotated:
        pass  # a constrained scalar (StrictStr ...): a leaf
    elif origin is list:
        if not isinstance(value, list):
            errors.append(f"{path}: must be a list, got {value!r:.60}")
            return
        (item,) = typing.get_args(annotation)
        for i, element in enumerate(value):
            _walk(element, item, f"{path}[{i}]", errors)
        return
    elif origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: must be a map, got {value!r:.60}")
            return
        _, item = typing.get_args(annotation)
        for key, element in value.items():
            if not isinstance(key, str):
                errors.append(f"{path}: key {key!r} must be a string")
            _walk(element, item, _join(path, str(key)), errors)
        return
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        _walk_model(value, annotation, path, errors)
        return
    try:
        TypeAdapter(annotation).validate_python(value, strict=True)
    except ValidationError as e:
        why = "; ".join(err["msg"] for err in e.errors())
        errors.append(f"{path}: {why}, got {value!r:.60}")


def _walk_model(value: Any, model: type[BaseModel], path: str, errors: list[str]) -> None:
    name = model.__name__
    if _is_one_of(model):
        try:
            model.from_json(json.dumps(value))  # type: ignore[attr-defined]
        except ValueError as e:
            errors.append(f"{path}: not a valid {name}: {str(e).splitlines()[0]}")
        return
    if not isinstance(value, dict):
        errors.append(f"{path}: must be an object ({name}), got {value!r:.60}")
        return
    fields = {(info.alias or attr): info for attr, info in model.model_fields.items()}
    for key, element in value.items():
        info = fields.get(key)
        if info is None:
            errors.append(
                f"{_join(path, key)}: unknown field {key!r} of {name} (known: "
                f"{', '.join(sorted(fields))})"
            )
            continue
        _walk(element, info.annotation, _join(path, key), errors)
    for key, info in fields.items():
        if info.is_required() and key not in value:
            errors.append(f"{_join(path, key)}: required field of {name} is missing")
