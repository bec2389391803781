"""The doubles the operator tests share, in one place: a task instance and its state store,
loggers that keep what the launchers write, and the slices of the Docker and Kubernetes
clients each launcher calls (a real podman engine and pods-as-containers run in
``tests/engines/``; these stand where no engine or cluster can)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
from kubernetes.client.exceptions import ApiException


@dataclass
class FakeTI:
    """The one attribute of a TaskInstance the operators read."""

    try_number: int = 1


class TaskStateStore(dict):  # type: ignore[type-arg]
    """Airflow 3.3's ``context["task_state_store"]`` as a task sees it (``get``, ``set``,
    ``delete``, ``clear``), kept in memory across the tries of one test. The scheduler test
    (tests/engines/test_worker_killed.py) uses Airflow's own."""

    def set(self, key: str, value: Any) -> None:
        self[key] = value

    def delete(self, key: str) -> None:
        self.pop(key, None)


class LineLog:
    """A logger double for launchers: keeps each formatted message."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def _add(self, msg: str, *args: Any) -> None:
        self.lines.append(msg % args if args else msg)

    info = warning = error = debug = _add


class TaskLog:
    """The operator's task log: Airflow 3 logs through structlog to stdout."""

    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self._capsys = capsys
        self._seen = ""

    @property
    def text(self) -> str:
        captured = self._capsys.readouterr()
        self._seen += captured.out + captured.err
        return self._seen


class FakeDockerClient:
    """The slice of ``docker.APIClient`` the launcher uses."""

    def __init__(self, chunks: list[bytes], status: dict[str, Any] | Exception, block=None):
        self.chunks, self.status, self.block = chunks, status, block
        self.calls: list[tuple[str, Any]] = []
        self.created: dict[str, Any] = {}
        self.images: set[str] = {"hva/trainer:1"}  # what the engine has
        self.pull_events: list[dict[str, Any]] = [
            {"status": "Pulling fs layer"},
            {"status": "Done"},
        ]

    def create_host_config(self, **kwargs: Any) -> Any:
        # docker-py's real HostConfig (imported here: the repo's docker/ folder would make
        # ruff's isort file a top-level ``import docker`` as first-party)
        from docker.types import HostConfig

        return HostConfig(version="1.43", **kwargs)

    def inspect_image(self, image: str) -> dict[str, Any]:
        from docker.errors import ImageNotFound

        self.calls.append(("inspect_image", image))
        if image not in self.images:
            raise ImageNotFound(f"No such image: {image}")
        return {"Id": "sha256:feed"}

    def pull(self, repository: str, tag=None, stream=False, decode=False):
        self.calls.append(("pull", f"{repository}:{tag}"))
        for event in self.pull_events:
            if "error" not in event:
                continue
            yield event
            return
        self.images = {*self.images, f"{repository}:{tag}"}
        yield from self.pull_events

    existing: dict[str, Any] | None = None  # inspect_container's answer for the job's name
    race: dict[str, Any] | None = None  # becomes ``existing`` as the first create is refused

    def create_container(self, **kwargs: Any) -> dict[str, str]:
        from docker.errors import APIError

        self.calls.append(("create", kwargs["name"]))
        if self.race is not None:
            self.existing, self.race = self.race, None
            raise APIError("Conflict", response=mock.Mock(status_code=409))
        if self.existing is not None:
            raise APIError("Conflict", response=mock.Mock(status_code=409))
        self.created = kwargs
        return {"Id": "c0ffee" * 10}

    def inspect_container(self, name_or_id: str) -> dict[str, Any]:
        from docker.errors import NotFound

        self.calls.append(("inspect", name_or_id))
        if self.existing and name_or_id in (self.existing["Name"], self.existing["Id"]):
            return self.existing
        raise NotFound(f"No such container: {name_or_id}")

    archives: list[tuple[str, bytes]]  # what put_archive received: (path, tar bytes)
    archive_errors: list[int]  # HTTP statuses the next put_archive calls fail with, in turn

    def put_archive(self, cid: str, path: str, data: bytes) -> bool:
        from docker.errors import APIError

        self.calls.append(("put_archive", path))
        self.archives = [*getattr(self, "archives", []), (path, data)]
        if errors := getattr(self, "archive_errors", []):
            status, self.archive_errors = errors[0], errors[1:]
            raise APIError(
                "passing bulk input to subprocess: write |1: broken pipe",
                response=mock.Mock(status_code=status),
            )
        return True

    def attach(self, cid: str, **kwargs: Any):
        self.calls.append(("attach", kwargs))
        return iter(self.chunks)

    def start(self, cid: str) -> None:
        self.calls.append(("start", cid))

    def wait(self, cid: str, timeout=None):
        self.calls.append(("wait", timeout))
        if self.block is not None:
            self.block.wait(30)
        if isinstance(self.status, Exception):
            raise self.status
        return self.status

    def stop(self, cid: str, timeout=None) -> None:
        self.calls.append(("stop", cid))
        if self.block is not None:
            self.block.set()

    def remove_container(self, cid: str, force=False) -> None:
        self.calls.append(("remove", force))
        if self.existing and cid == self.existing["Id"]:
            self.existing = None


#: Where the launcher makes its cluster client: the fake clusters are patched in there.
HOOK = "horovod_airflow.operators.launchers.kubernetes.client.KubernetesHook"


RUNNING: dict[str, Any] = {"status": {"conditions": [{"type": "Running", "status": "True"}]}}


SUCCEEDED = {
    "status": {
        "conditions": [
            {"type": "Running", "status": "False"},
            {"type": "Succeeded", "status": "True"},
        ]
    }
}


FAILED = {
    "status": {
        "conditions": [
            {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "launcher failed",
            }
        ]
    }
}


def pod(
    name: str,
    phase: str,
    *,
    role: str = "worker",
    waiting: tuple[str, str] | None = None,
    unschedulable: str | None = None,
    message: str | None = None,
) -> Any:
    """A ``V1Pod`` as the client returns it (the attributes the launcher reads)."""
    state = SimpleNamespace(
        waiting=SimpleNamespace(reason=waiting[0], message=waiting[1]) if waiting else None
    )
    conditions = []
    if unschedulable:
        conditions.append(
            SimpleNamespace(
                type="PodScheduled", status="False", reason="Unschedulable", message=unschedulable
            )
        )
    return SimpleNamespace(
        metadata=SimpleNamespace(name=name, labels={"role": role}),
        status=SimpleNamespace(
            phase=phase,
            message=message,
            reason=None,
            conditions=conditions,
            init_container_statuses=None,
            container_statuses=[SimpleNamespace(name=role, state=state)],
        ),
    )


class FakeCore:
    def __init__(self, log_text: str) -> None:
        self.secrets: dict[str, Any] = {}
        self.deleted: list[str] = []
        self.log_text = log_text
        self.created_secret_text = ""  # every Secret's data, kept after deletion
        self.selectors: list[str] = []
        self.log_reads: list[dict[str, Any]] = []
        # what successive pod listings answer: by default the job's launcher pod, running
        self.pods: list[list[Any]] = [[pod("job-launcher-abc", "Running", role="launcher")]]

    def create_namespaced_secret(self, namespace: str, body: dict[str, Any]) -> None:
        self.secrets[body["metadata"]["name"]] = body
        self.created_secret_text += json.dumps(body["stringData"])

    def patch_namespaced_secret(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.secrets[name]["metadata"].update(body["metadata"])
        if "stringData" in body:
            self.secrets[name]["stringData"] = body["stringData"]
            self.created_secret_text += json.dumps(body["stringData"])

    def delete_namespaced_secret(self, name: str, namespace: str) -> None:
        if name not in self.secrets:
            raise ApiException(status=404)
        del self.secrets[name]
        self.deleted.append(name)

    def list_namespaced_pod(self, namespace: str, label_selector: str) -> Any:
        self.selectors.append(label_selector)
        pods = self.pods.pop(0) if len(self.pods) > 1 else self.pods[0]
        if label_selector.endswith("job-role=launcher"):
            pods = [p for p in pods if p.metadata.labels.get("role") == "launcher"]
        return SimpleNamespace(items=pods)

    def read_namespaced_pod_log(self, name: str, namespace: str, **kw: Any) -> Any:
        """The log as the API serves it: ``timestamps=True`` prefixes each line with its
        RFC3339Nano time; ``follow=True, _preload_content=False`` answers a response whose
        ``stream()`` yields the bytes."""
        self.log_reads.append(kw)
        text = self.log_text
        if kw.get("timestamps"):
            text = "".join(
                f"2026-12-04T10:00:00.{i:09d}Z {line}\n"
                for i, line in enumerate(self.log_text.splitlines(), 1)
            )
        if kw.get("_preload_content") is False:
            return LogStream([text.encode()])
        return text


class LogStream:
    """A streamed log response (``urllib3.HTTPResponse``): ``stream()`` yields its chunks."""

    def __init__(self, chunks: Any) -> None:
        self.chunks = chunks
        self.closed = False

    def stream(self, amt: Any = None, decode_content: bool = True) -> Any:
        for chunk in self.chunks:
            if self.closed:
                return
            yield chunk

    def release_conn(self) -> None:
        self.closed = True

    def close(self) -> None:
        self.closed = True


class FakeHook:
    """Serves ``phases`` (MPIJob states, or exceptions to raise) to successive looks."""

    def __init__(self, phases: list[Any], log_text: str = "") -> None:
        self.phases = list(phases)
        self.core_v1_client = FakeCore(log_text)
        self.objects: dict[str, dict[str, Any]] = {}
        self.created: dict[str, dict[str, Any]] = {}  # kept after deletion
        self.deleted: list[str] = []
        self.gets = 0  # looks at an existing MPIJob
        self.linger = 0  # get calls for which the next deleted MPIJob is still there
        self.lingering: dict[str, int] = {}

    def get_namespace(self) -> str:
        return "ml"

    def create_custom_object(self, group, version, plural, body, namespace=None):
        assert (group, version, plural) == ("kubeflow.org", "v2beta1", "mpijobs")
        if body["metadata"]["name"] in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        self.objects[body["metadata"]["name"]] = body
        self.created[body["metadata"]["name"]] = body
        return {**body, "metadata": {**body["metadata"], "uid": "uid-123"}}

    def get_custom_object(self, group, version, plural, name, namespace=None):
        if name not in self.objects:
            raise ApiException(status=404)
        if name in self.lingering:  # deleted, its pods still terminating
            self.lingering[name] -= 1
            if not self.lingering[name]:
                del self.lingering[name], self.objects[name]
            return {**RUNNING, "metadata": {"name": name, "deletionTimestamp": "2026-12-04T00:00Z"}}
        self.gets += 1
        answer = self.phases.pop(0) if len(self.phases) > 1 else self.phases[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def delete_custom_object(self, group, version, plural, name, namespace=None, **kw):
        if name not in self.objects:
            raise ApiException(status=404)
        self.deleted.append(name)
        if self.linger:  # the first deletion only
            self.lingering.setdefault(name, self.linger)
            self.linger = 0
        else:
            del self.objects[name]


NAME = "hvd-train-1234"


TRAINJOBS = ("trainer.kubeflow.org", "v1alpha1", "trainjobs")


RUNTIMES = ("trainer.kubeflow.org", "v1alpha1", "trainingruntimes")


class FakeCustomObjects:
    def __init__(self, hook: TrainerHook) -> None:
        self.hook = hook

    def patch_namespaced_custom_object(self, group, version, plural, name, namespace, body):
        self.hook.objects[(group, version, plural)][name]["metadata"].update(body["metadata"])


class TrainerHook:
    """Serves ``phases`` (TrainJob states, or exceptions) to successive looks at the TrainJob;
    keeps TrainingRuntimes as they were created."""

    def __init__(self, phases: list[Any], log_text: str = "") -> None:
        self.phases = list(phases)
        self.core_v1_client = FakeCore(log_text)
        self.core_v1_client.pods = [[pod(f"{NAME}-launcher-0-0-x", "Running", role="launcher")]]
        self.custom_object_client = FakeCustomObjects(self)
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {TRAINJOBS: {}, RUNTIMES: {}}
        self.created: list[tuple[str, str]] = []  # (plural, name), in order
        self.deleted: list[tuple[str, str]] = []

    def get_namespace(self) -> str:
        return "ml"

    def create_custom_object(self, group, version, plural, body, namespace=None):
        store = self.objects[(group, version, plural)]
        name = body["metadata"]["name"]
        if name in store:
            raise ApiException(status=409, reason="AlreadyExists")
        store[name] = json.loads(json.dumps(body))
        self.created.append((plural, name))
        return {**body, "metadata": {**body["metadata"], "uid": f"uid-{plural}"}}

    def get_custom_object(self, group, version, plural, name, namespace=None):
        store = self.objects[(group, version, plural)]
        if name not in store:
            raise ApiException(status=404)
        if plural == "trainingruntimes":
            return store[name]
        answer = self.phases.pop(0) if len(self.phases) > 1 else self.phases[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def delete_custom_object(self, group, version, plural, name, namespace=None, **kw):
        store = self.objects[(group, version, plural)]
        if name not in store:
            raise ApiException(status=404)
        assert kw.get("propagation_policy") == "Foreground"
        del store[name]
        self.deleted.append((plural, name))
