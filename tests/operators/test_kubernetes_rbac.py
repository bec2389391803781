"""The least RBAC of the kubernetes launcher (docs/kubernetes-rbac.md) is what its code calls.

The launcher's scenarios (a job that succeeds, fails, is killed, is re-attached by a retry,
gets fresh credentials, is waited on by the deferrable trigger; MPIJob, elastic MPIJob and
TrainJob) run
against the suite's fake clusters with every API call recorded as (API group, resource,
verb). The Role in the document must grant each of them, and nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.operators import fakes
from tests.operators import test_kubernetes_launcher as mpijob_tests
from tests.operators import test_trainjob_launcher as trainjob_tests

DOC = REPO / "docs" / "kubernetes-rbac.md"
#: client method → (verb, resource of the core API, or None where the call names its own)
CALLS: dict[str, tuple[str, str | None]] = {
    "create_custom_object": ("create", None),
    "get_custom_object": ("get", None),
    "delete_custom_object": ("delete", None),
    "patch_namespaced_custom_object": ("patch", None),
    "list_namespaced_custom_object": ("list", None),
    "create_namespaced_secret": ("create", "secrets"),
    "patch_namespaced_secret": ("patch", "secrets"),
    "delete_namespaced_secret": ("delete", "secrets"),
    "read_namespaced_secret": ("get", "secrets"),
    "list_namespaced_pod": ("list", "pods"),
    "read_namespaced_pod": ("get", "pods"),
    "read_namespaced_pod_log": ("get", "pods/log"),
    "list_namespaced_event": ("list", "events"),
}
FAKES = (fakes.FakeHook, fakes.FakeCore, fakes.TrainerHook, fakes.FakeCustomObjects)


def _record(monkeypatch: pytest.MonkeyPatch) -> set[tuple[str, str, str]]:
    calls: set[tuple[str, str, str]] = set()
    for fake in FAKES:
        for method, (verb, resource) in CALLS.items():
            original = fake.__dict__.get(method)
            if original is None:
                continue

            def recorder(
                *args: Any, _f: Callable[..., Any] = original, _v: str = verb,
                _r: str | None = resource, **kwargs: Any,
            ) -> Any:  # fmt: skip
                if _r is None:  # (self, group, version, plural, ...)
                    group = kwargs.get("group", args[1] if len(args) > 1 else None)
                    plural = kwargs.get("plural", args[3] if len(args) > 3 else None)
                    calls.add((str(group), str(plural), _v))
                else:
                    calls.add(("", _r, _v))
                return _f(*args, **kwargs)

            monkeypatch.setattr(fake, method, recorder)
    return calls


def _scenarios(tmp_path: Any) -> None:
    """The launcher's paths, as the launcher tests drive them."""
    m, t = mpijob_tests, trainjob_tests
    m.test_polling_success_creates_secret_surfaces_log_and_cleans_up()
    m.test_failure_raises_with_launcher_log_and_keeps_the_job()
    m.test_a_failure_names_the_worker_pod_of_the_rank_that_failed_first()
    m.test_an_elastic_mpijob_makes_the_same_calls_and_a_failure_names_the_lost_pod()
    m.test_on_kill_deletes_job_and_secret_idempotently()
    m.test_a_stale_secret_gets_this_tries_credentials()
    m.test_a_retry_that_finds_the_job_being_deleted_waits_until_gone_then_starts_its_own()
    m.test_a_409_on_create_reattaches_to_the_job_that_appeared()
    m.test_the_launcher_log_is_followed_into_the_task_log_while_the_job_runs()
    m.test_a_job_that_cannot_start_fails_the_task_fast_and_is_deleted(
        *_first_params(m.test_a_job_that_cannot_start_fails_the_task_fast_and_is_deleted)
    )
    m.test_a_deferrable_retry_while_the_job_runs_defers_on_it_without_a_second_job(tmp_path)
    m.test_the_deferred_task_fails_fast_on_a_start_failure_and_deletes_the_job(tmp_path)
    t.test_polling_success_makes_runtime_then_job_owns_both_and_cleans_up()
    t.test_a_failed_trainjob_names_the_node_pod_of_the_rank_that_failed_first()
    t.test_a_runtime_left_without_its_job_is_replaced_by_this_tries()
    t.test_a_409_on_the_trainjob_create_reattaches_to_the_job_that_appeared()
    t.test_the_deferrable_operator_defers_on_the_trainjob_and_finishes_it(tmp_path)


def _first_params(test: Callable[..., Any]) -> tuple[Any, ...]:
    """The first parameter set of a parametrized test function."""
    (mark,) = [m for m in getattr(test, "pytestmark", []) if m.name == "parametrize"]
    first = mark.args[1][0]
    return tuple(first.values if hasattr(first, "values") else first)


def _documented_role() -> set[tuple[str, str, str]]:
    text = DOC.read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
    roles = [d for b in blocks for d in yaml.safe_load_all(b) if d and d.get("kind") == "Role"]
    assert len(roles) == 1, f"{DOC} must hold exactly one Role"
    granted = set()
    for rule in roles[0]["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    granted.add((group, resource, verb))
    return granted


def test_the_documented_role_grants_exactly_what_the_launcher_calls(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, s3_server: Any
) -> None:
    calls = _record(monkeypatch)
    _scenarios(tmp_path)
    assert calls, "no API call was recorded: the scenarios did not reach the fakes"
    granted = _documented_role()
    missing = calls - granted
    unused = granted - calls
    assert not missing, f"{DOC.name} does not grant what the launcher calls: {sorted(missing)}"
    assert not unused, f"{DOC.name} grants what the launcher never calls: {sorted(unused)}"
