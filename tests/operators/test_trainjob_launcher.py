"""The kubernetes launcher's Kubeflow Trainer v2 flavour (``kubernetes_api="trainjob"``): a
TrainJob and its own TrainingRuntime, with the provider hook patched where it is imported (no
cluster on the test machine). The hook double keeps the created objects per resource type and
serves scripted TrainJob conditions, pod listings and a launcher pod log."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from airflow.sdk.exceptions import TaskDeferred
from kubernetes.client.exceptions import ApiException

from horovod_airflow.operators import HorovodLaunchError, HorovodTrainingError, HorovodTrainOperator
from horovod_airflow.operators.launchers.kubernetes import (
    KubernetesLauncher,
    KubernetesOptions,
    PodOptions,
    build_trainjob,
    trainjob_phase,
)
from horovod_airflow.operators.launchers.kubernetes.api import (
    ANCESTOR_LABEL,
    JOBSET_NAME_LABEL,
    JOBSET_ROLE_LABEL,
)
from horovod_airflow.operators.launchers.kubernetes.manifests import (
    POD_SECURITY,
    SSH_AUTH_MOUNT_PATH,
    WORKER_COMMAND,
)
from horovod_airflow.operators.triggers import MPIJobTrigger
from tests.operators.fakes import (
    HOOK,
    NAME,
    RUNTIMES,
    TRAINJOBS,
    LineLog,
    TrainerHook,
    pod,
)
from tests.operators.helpers import context
from tests.operators.test_kubernetes_launcher import POD_OPTIONS, SECRET, k8s_train_op, spec
from tests.operators.trainjob_schema import trainjob_errors

RUNNING: dict[str, Any] = {"status": {"conditions": [{"type": "Created", "status": "True"}]}}
COMPLETE = {"status": {"conditions": [{"type": "Complete", "status": "True", "message": "ok"}]}}
FAILED = {
    "status": {
        "conditions": [
            {"type": "Failed", "status": "True", "reason": "JobsFailed", "message": "launcher"}
        ]
    }
}


def launcher(hook: TrainerHook, **kw: Any) -> KubernetesLauncher:
    kw.setdefault("poll_interval", 0.01)
    options = KubernetesOptions(slots_per_worker=2, kubernetes_api="trainjob", **kw)
    return KubernetesLauncher(image="hva/trainer:1", hook=hook, options=options)


def replicated(runtime: dict[str, Any]) -> dict[str, dict[str, Any]]:
    jobs = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return {job["name"]: job for job in jobs}


def test_the_trainjob_references_its_own_mpi_runtime_of_the_mpijobs_pods():
    runtime, trainjob = build_trainjob(
        spec(), image="hva/trainer:1", namespace="ml", slots_per_worker=2
    )
    assert trainjob["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
    assert trainjob["kind"] == "TrainJob" and runtime["kind"] == "TrainingRuntime"
    assert trainjob["metadata"]["name"] == runtime["metadata"]["name"] == NAME
    assert trainjob["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "TrainingRuntime",
        "name": NAME,
    }
    assert trainjob["spec"]["trainer"] == {"numNodes": 2}  # 4 ranks, 2 per node
    assert trainjob["spec"]["activeDeadlineSeconds"] == 3600
    policy = runtime["spec"]["mlPolicy"]
    assert policy == {
        "numNodes": 2,
        "mpi": {
            "mpiImplementation": "OpenMPI",
            "numProcPerNode": 2,
            "sshAuthMountPath": SSH_AUTH_MOUNT_PATH,
            "runLauncherAsNode": False,
        },
    }
    jobset = runtime["spec"]["template"]["spec"]
    # the sshd nodes first, then the launcher, each once the one before is ready
    assert [j["name"] for j in jobset["replicatedJobs"]] == ["node", "launcher"]
    assert jobset["startupPolicy"] == {"startupPolicyOrder": "InOrder"}
    assert jobset["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["launcher"]}
    jobs = replicated(runtime)
    assert jobs["node"]["template"]["metadata"]["labels"] == {ANCESTOR_LABEL: "trainer"}
    assert jobs["node"]["template"]["spec"]["parallelism"] == 2
    node = jobs["node"]["template"]["spec"]["template"]["spec"]
    boss = jobs["launcher"]["template"]["spec"]["template"]["spec"]
    assert node["containers"][0]["name"] == "node"
    assert node["containers"][0]["command"] == list(WORKER_COMMAND)
    assert node["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    assert node["restartPolicy"] == boss["restartPolicy"] == "Never"
    command = boss["containers"][0]["command"]
    hosts = [f"{NAME}-node-0-{i}.{NAME}.ml.svc:2" for i in range(2)]
    assert command[command.index("-H") + 1] == ",".join(hosts)
    assert command[command.index("-p") + 1] == "2222"
    assert SECRET not in json.dumps([runtime, trainjob])  # only the Secret holds it
    for pod_spec in (node, boss):
        assert pod_spec["volumes"][0]["secret"]["secretName"] == f"{NAME}-rank-env"
        assert pod_spec["securityContext"] == POD_SECURITY


def test_pod_settings_reach_both_trainjob_pods_from_the_operator():
    # k8s_train_op groups these into kubernetes=KubernetesOptions(kubernetes_api="trainjob", ...)
    op = k8s_train_op(kubernetes_api="trainjob", **POD_OPTIONS)
    assert op.options("kubernetes").kubernetes_api == "trainjob"
    job = op.build_spec(context())
    launcher_ = op.make_launcher()
    assert isinstance(launcher_, KubernetesLauncher) and launcher_.flavour.api == "trainjob"
    with mock.patch(
        HOOK,
        return_value=TrainerHook([]),
    ):
        runtime, _ = launcher_.manifests(job)
    for role, rjob in replicated(runtime).items():
        pod_spec = rjob["template"]["spec"]["template"]["spec"]
        assert pod_spec["serviceAccountName"] == "trainer-sa", role
        assert pod_spec["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}], role
        assert pod_spec["nodeSelector"] == {"gpu": "h200"}, role
        assert pod_spec["tolerations"] == POD_OPTIONS["tolerations"], role
        assert pod_spec["priorityClassName"] == "training", role
        assert pod_spec["containers"][0]["imagePullPolicy"] == "Always", role
    labels = runtime["spec"]["template"]["metadata"]["labels"]
    assert labels["horovod-airflow/job"] == job.name and labels["task_id"] == "train"


def test_a_bad_kubernetes_api_is_named_and_it_is_a_kubernetes_option():
    with pytest.raises(ValueError, match="kubernetes_api must be one of 'mpijob', 'trainjob'"):
        KubernetesOptions(kubernetes_api="pytorchjob")
    base = dict(task_id="t", data="s3://b/d", output="s3://b/o", image="i:1")
    trainjob = KubernetesOptions(kubernetes_api="trainjob")
    with pytest.raises(ValueError, match=r"kubernetes=KubernetesOptions\(...\) is for launcher"):
        HorovodTrainOperator(launcher="docker", kubernetes=trainjob, **base)
    # the former loose keyword is refused, naming the object it belongs to
    with pytest.raises(
        ValueError,
        match=re.escape("kubernetes_api is an option of launcher 'kubernetes' only: pass "
                        "kubernetes=KubernetesOptions(kubernetes_api=...)"),
    ):  # fmt: skip
        HorovodTrainOperator(launcher="kubernetes", kubernetes_api="trainjob", **base)


def test_trainjob_overrides_merge_per_kind_and_owned_paths_are_refused():
    node_pod = {
        "hostIPC": True,
        "containers": [{"name": "node", "env": [{"name": "NCCL_DEBUG", "value": "INFO"}]}],
    }
    overrides = {
        "TrainingRuntime": {"spec": {"template": {"spec": {"replicatedJobs": [
            {"name": "node", "template": {"spec": {"template": {"spec": node_pod}}}}]}}}},
        "TrainJob": {"metadata": {"annotations": {"team": "ml"}}},
    }  # fmt: skip
    runtime, trainjob = launcher(TrainerHook([]), trainjob_overrides=overrides).manifests(spec())
    node = replicated(runtime)["node"]["template"]["spec"]["template"]["spec"]
    assert node["hostIPC"] is True and node["securityContext"] == POD_SECURITY
    env = {e["name"]: e.get("value") for e in node["containers"][0]["env"]}
    assert env["NCCL_DEBUG"] == "INFO" and env["PYTHONUNBUFFERED"] == "1"
    assert node["containers"][0]["command"] == list(WORKER_COMMAND)  # the launcher's stay
    assert list(replicated(runtime)) == ["node", "launcher"]
    assert trainjob["metadata"]["annotations"] == {"team": "ml"}
    assert trainjob_errors(runtime) == [] and trainjob_errors(trainjob) == []

    owned = [
        ({"TrainJob": {"spec": {"activeDeadlineSeconds": 5}}}, "TrainJob", "execution_timeout"),
        ({"TrainJob": {"spec": {"runtimeRef": {"name": "x"}}}}, "TrainJob", "spec.runtimeRef"),
        ({"TrainJob": {"spec": {"trainer": {"numNodes": 9}}}}, "TrainJob", "numNodes"),
        ({"TrainingRuntime": {"metadata": {"name": "x"}}}, "TrainingRuntime", "metadata.name"),
        ({"TrainingRuntime": {"spec": {"mlPolicy": {"mpi": {"numProcPerNode": 8}}}}},
         "TrainingRuntime", "numProcPerNode"),
        ({"TrainingRuntime": {"spec": {"template": {"spec": {"replicatedJobs": [
            {"name": "launcher", "template": {"spec": {"template": {"spec": {"containers": [
                {"name": "launcher", "command": ["sh"]}]}}}}}]}}}}},
         "TrainingRuntime", "containers.launcher.command"),
        ({"TrainingRuntime": {"spec": {"template": {"spec": {"replicatedJobs": [
            {"name": "node", "template": {"spec": {"parallelism": 9}}}]}}}}},
         "TrainingRuntime", "node.template.spec.parallelism"),
    ]  # fmt: skip
    for override, kind, named in owned:
        with pytest.raises(
            ValueError, match=rf"trainjob_overrides\['{kind}'\] sets .*{re.escape(named)}"
        ):
            launcher(TrainerHook([]), trainjob_overrides=override).manifests(spec())


def test_each_flavours_overrides_are_refused_by_the_other_and_kinds_are_checked():
    with pytest.raises(ValueError, match="mpijob_overrides applies to kubernetes_api='mpijob'"):
        KubernetesOptions(kubernetes_api="trainjob", mpijob_overrides={"spec": {}})
    with pytest.raises(ValueError, match="trainjob_overrides applies to kubernetes_api='trai"):
        KubernetesOptions(trainjob_overrides={"TrainJob": {"spec": {}}})
    with pytest.raises(ValueError, match="trainjob_overrides must be a dict of manifest kind"):
        KubernetesOptions(kubernetes_api="trainjob", trainjob_overrides={"JobSet": {}})


@pytest.mark.parametrize(
    ("obj", "phase"),
    [(None, "running"), (RUNNING, "running"), (COMPLETE, "succeeded"), (FAILED, "failed")],
)
def test_trainjob_phase(obj, phase):
    assert trainjob_phase(obj)[0] == phase


def test_polling_success_makes_runtime_then_job_owns_both_and_cleans_up():
    hook = TrainerHook([RUNNING, RUNNING, COMPLETE], log_text="[0]<stdout>:epoch 1")
    log = LineLog()
    owned: dict[str, Any] = {}
    real_delete = hook.delete_custom_object

    def delete(group, version, plural, name, namespace=None, **kw):
        if plural == "trainjobs":  # what the job owns, as it is deleted
            owned["runtime"] = hook.objects[RUNTIMES][name]["metadata"]["ownerReferences"]
            owned["secret"] = hook.core_v1_client.secrets[f"{name}-rank-env"]["metadata"][
                "ownerReferences"
            ]
        return real_delete(group, version, plural, name, namespace, **kw)

    hook.delete_custom_object = delete  # type: ignore[method-assign]
    result = launcher(hook).run(spec(), log)
    assert result.exit_code == 0 and "[0]<stdout>:epoch 1" in log.lines
    assert hook.created == [("trainingruntimes", NAME), ("trainjobs", NAME)]
    owner = [{"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "name": NAME,
              "uid": "uid-trainjobs"}]  # fmt: skip
    assert owned == {"runtime": owner, "secret": owner}
    assert hook.deleted == [("trainjobs", NAME), ("trainingruntimes", NAME)]
    assert hook.core_v1_client.deleted == [f"{NAME}-rank-env"]
    assert f"{JOBSET_NAME_LABEL}={NAME}" in hook.core_v1_client.selectors
    assert f"{JOBSET_NAME_LABEL}={NAME},{JOBSET_ROLE_LABEL}=launcher" in (
        hook.core_v1_client.selectors
    )
    assert any("submitted TrainJob ml/hvd-train-1234 (4 ranks)" in line for line in log.lines)


def test_a_failed_trainjob_names_the_node_pod_of_the_rank_that_failed_first():
    log_text = "[2]<stderr>:RuntimeError: boom\nProcess name: 2\nExit code: 1"
    hook = TrainerHook([RUNNING, FAILED], log_text=log_text)
    with pytest.raises(HorovodTrainingError, match="TrainJob ml/hvd-train-1234 failed") as err:
        launcher(hook).run(spec(), LineLog())
    assert "JobsFailed: launcher" in str(err.value)
    assert f"rank 2 (host {NAME}-node-0-1.{NAME}.ml.svc) failed first" in str(err.value)
    # delete_on_success: the failed job and its runtime are kept, its credentials are not
    assert hook.deleted == [] and hook.core_v1_client.deleted == [f"{NAME}-rank-env"]


def left(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "metadata": {"name": NAME, "labels": {"try_number": "1"}}}


@pytest.mark.parametrize(
    ("earlier", "message"),
    [
        (RUNNING, "TrainJob ml/hvd-train-1234 of this task instance (made by try 1) is still"),
        (COMPLETE, "deleting TrainJob ml/hvd-train-1234 (made by try 1, succeeded: ok)"),
        (FAILED, "deleting TrainJob ml/hvd-train-1234 (made by try 1, failed: JobsFailed"),
    ],
    ids=["running", "succeeded", "failed"],
)
def test_a_retry_reattaches_to_a_running_trainjob_and_replaces_a_finished_one(earlier, message):
    hook = TrainerHook([left(earlier), COMPLETE])
    hook.objects[TRAINJOBS][NAME] = {"metadata": {"name": NAME}}
    hook.objects[RUNTIMES][NAME] = {"metadata": {"name": NAME}, "spec": {}}
    log = LineLog()
    assert launcher(hook).run(spec(labels={"try_number": "2"}), log).exit_code == 0
    assert any(message in line for line in log.lines), log.lines
    if earlier is RUNNING:
        # waited for, not duplicated: no runtime, no TrainJob, no Secret written by this try
        assert hook.created == [] and hook.core_v1_client.created_secret_text == ""
        assert hook.deleted == [("trainjobs", NAME), ("trainingruntimes", NAME)]
    else:
        # the finished one and its runtime are gone before this try's are created
        assert hook.created == [("trainingruntimes", NAME), ("trainjobs", NAME)]
        made = hook.deleted[:2]
        assert made == [("trainjobs", NAME), ("trainingruntimes", NAME)]


def test_a_deferrable_retry_while_the_trainjob_runs_defers_on_it_without_a_second_job(tmp_path):
    op = k8s_train_op(kubernetes_api="trainjob", deferrable=True, output=str(tmp_path / "o"))
    name = op.build_spec(context()).name
    hook = TrainerHook([{**RUNNING, "metadata": {"name": name, "labels": {"try_number": "1"}}}])
    hook.objects[TRAINJOBS][name] = {"metadata": {"name": name}}
    hook.objects[RUNTIMES][name] = {"metadata": {"name": name}, "spec": {}}
    with (
        mock.patch(
            HOOK,
            return_value=hook,
        ),
        pytest.raises(TaskDeferred) as deferred,
    ):
        op.execute(context(try_number=2))
    assert hook.created == [] and hook.deleted == []
    trigger = deferred.value.trigger
    assert trigger.name == name and trigger.kubernetes_api == "trainjob"


def test_a_runtime_left_without_its_job_is_replaced_by_this_tries():
    hook = TrainerHook([COMPLETE])
    hook.objects[RUNTIMES][NAME] = {"metadata": {"name": NAME}, "spec": {"stale": True}}
    launcher(hook).submit(spec(), LineLog())
    assert hook.deleted == [("trainingruntimes", NAME)]
    assert "mlPolicy" in hook.objects[RUNTIMES][NAME]["spec"]


def test_a_409_on_the_trainjob_create_reattaches_to_the_job_that_appeared():
    hook = TrainerHook([COMPLETE])
    real_create = hook.create_custom_object

    def raced(group, version, plural, body, namespace=None):
        if plural == "trainjobs":
            real_create(group, version, plural, body, namespace)
        return real_create(group, version, plural, body, namespace)

    hook.create_custom_object = raced  # type: ignore[method-assign]
    log = LineLog()
    assert launcher(hook).run(spec(), log).exit_code == 0
    assert any("TrainJob ml/hvd-train-1234 appeared while this try" in ln for ln in log.lines)


def test_a_failed_create_leaves_no_runtime_and_no_secret_behind():
    hook = TrainerHook([RUNNING])
    real_create = hook.create_custom_object

    def refuse(group, version, plural, body, namespace=None):
        if plural == "trainjobs":
            raise ApiException(status=422, reason="Invalid")
        return real_create(group, version, plural, body, namespace)

    hook.create_custom_object = refuse  # type: ignore[method-assign]
    with pytest.raises(HorovodLaunchError, match="cannot create TrainJob 'hvd-train-1234'"):
        launcher(hook).submit(spec(), LineLog())
    assert hook.objects[RUNTIMES] == {} and hook.core_v1_client.secrets == {}


def test_a_trainjob_that_cannot_start_fails_fast_naming_the_pod_and_is_deleted():
    hook = TrainerHook([RUNNING])
    node = f"{NAME}-node-0-0-abcde"
    hook.core_v1_client.pods = [[pod(node, "Pending", waiting=("ErrImagePull", "not found"))]]
    with pytest.raises(HorovodLaunchError, match=re.escape(f"pod {node} (container worker)")):
        launcher(hook).run(spec(), LineLog())
    assert hook.deleted == [("trainjobs", NAME), ("trainingruntimes", NAME)]


def test_no_pod_at_all_names_trainer_and_jobset():
    hook = TrainerHook([RUNNING])
    hook.core_v1_client.pods = [[]]
    with pytest.raises(HorovodLaunchError, match="no pod of TrainJob hvd-train-1234 after"):
        launcher(hook, startup_timeout=0.03).run(spec(), LineLog())


def test_the_deferrable_operator_defers_on_the_trainjob_and_finishes_it(tmp_path):
    """The trigger and the TrainJob's activeDeadlineSeconds get the execution_timeout deadline
    (Airflow 3 does not apply execution_timeout to a deferred wait)."""
    op = k8s_train_op(
        kubernetes_api="trainjob",
        deferrable=True,
        output=str(tmp_path / "o"),
        execution_timeout=timedelta(hours=1),
    )
    options = op.options("kubernetes")
    assert options.kubernetes_api == "trainjob" and options.deferrable
    hook = TrainerHook([FAILED], log_text="[0]<stdout>:step")
    with mock.patch(HOOK, return_value=hook):
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(context())
        trigger = deferred.value.trigger
        assert isinstance(trigger, MPIJobTrigger) and trigger.kubernetes_api == "trainjob"
        path, kwargs = trigger.serialize()
        assert kwargs["kubernetes_api"] == "trainjob"
        assert MPIJobTrigger(**kwargs).serialize() == (path, kwargs)
        assert 3600 - 60 - 5 < trigger.timeout <= 3600 - 60
        trainjob = hook.objects[TRAINJOBS][trigger.name]
        assert trainjob["spec"]["activeDeadlineSeconds"] == int(trigger.timeout)
        events = asyncio.run(_events(trigger))
        assert [e.payload["status"] for e in events] == ["failed"]
        with pytest.raises(HorovodTrainingError, match=r"TrainJob ml/.* failed: JobsFailed"):
            op.execute_complete(context(), event=events[0].payload, **deferred.value.kwargs)
    assert ("trainjobs", trigger.name) in hook.created


async def _events(trigger: MPIJobTrigger) -> list[Any]:
    return [event async for event in trigger.run()]


def test_pod_options_are_shared_with_the_mpijob():
    options = PodOptions(**POD_OPTIONS)
    runtime, _ = build_trainjob(
        spec(), image="i", namespace="ml", slots_per_worker=2, pod_options=options
    )
    from horovod_airflow.operators.launchers.kubernetes import build_mpijob

    mpijob = build_mpijob(
        spec(), image="i", namespace="ml", slots_per_worker=2, pod_options=options
    )
    node = replicated(runtime)["node"]["template"]["spec"]["template"]
    worker = mpijob["spec"]["mpiReplicaSpecs"]["Worker"]["template"]
    node_spec = {k: v for k, v in node["spec"].items() if k != "restartPolicy"}
    assert node_spec["containers"][0].pop("name") == "node"
    worker["spec"]["containers"][0].pop("name")
    assert node_spec == worker["spec"] and node["metadata"] == worker["metadata"]


def trainer_manifests() -> dict[str, dict[str, Any]]:
    """Every TrainingRuntime and TrainJob the launcher builds, by shape."""
    from horovod_airflow.operators.job import job_labels

    labels = job_labels("mnist_horovod_retrain", "train", "manual__2026-12-04T18:49:33+00:00", 2)
    shapes = {
        "train, all pod settings": build_trainjob(
            spec(labels=labels), image="hva/trainer:1", namespace="ml", slots_per_worker=2,
            pod_options=PodOptions(**POD_OPTIONS),
        ),
        "one-rank export": tuple(launcher(TrainerHook([])).manifests(
            spec(num_proc=1, distributed=False, labels=labels)
        )),
        "cpu, no secrets, no timeout": build_trainjob(
            spec(gpus_per_proc=0, secret_env={}, timeout=None), image="hva/trainer:1",
            namespace="ml", slots_per_worker=1,
        ),
    }  # fmt: skip
    return {f"{shape}: {body['kind']}": body for shape, bodies in shapes.items() for body in bodies}


@pytest.mark.parametrize("shape", list(trainer_manifests()))
def test_every_trainer_manifest_passes_trainers_api_schema(shape):
    assert trainjob_errors(trainer_manifests()[shape]) == []


def _set(path: str, value: Any = None, *, delete: bool = False) -> Any:
    def mutate(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = body
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if delete:
            del node[last]
        else:
            node[last] = value

    return mutate


JOBS = "spec.template.spec.replicatedJobs"
NODE_POD = f"{JOBS}.0.template.spec.template.spec"


@pytest.mark.parametrize(
    ("kind", "mutate", "error"),
    [
        # misspelt keys, at each level: Trainer's, JobSet's, the core pod's
        ("TrainingRuntime", _set("spec.mlPolicy.mpi.numProcsPerNode", 2),
         "spec.mlPolicy.mpi.numProcsPerNode: unknown field 'numProcsPerNode' of "
         "TrainerV1alpha1MPIMLPolicySource"),
        ("TrainingRuntime", _set("spec.template.spec.startupPolicy.order", "InOrder"),
         "spec.template.spec.startupPolicy.order: unknown field 'order' of "
         "JobsetV1alpha2StartupPolicy"),
        ("TrainingRuntime", _set(f"{NODE_POD}.containers.0.commands", ["sshd"]),
         f"{JOBS}[0].template.spec.template.spec.containers[0].commands: unknown field"),
        ("TrainJob", _set("spec.runtimeRef.group", "trainer.kubeflow.org"),
         "spec.runtimeRef.group: unknown field 'group' of TrainerV1alpha1RuntimeRef"),
        # wrong types
        ("TrainingRuntime", _set("spec.mlPolicy.numNodes", "2"),
         "spec.mlPolicy.numNodes: Input should be a valid integer, got '2'"),
        ("TrainingRuntime", _set("spec.mlPolicy.mpi.runLauncherAsNode", "false"),
         "spec.mlPolicy.mpi.runLauncherAsNode: Input should be a valid boolean"),
        ("TrainingRuntime", _set(f"{NODE_POD}.containers.0.command", "sshd -D"),
         f"{JOBS}[0].template.spec.template.spec.containers[0].command: must be a list"),
        ("TrainingRuntime", _set(f"{NODE_POD}.containers.0.resources.limits.cpu", [4]),
         "containers[0].resources.limits.cpu: not a valid IoK8sApimachineryPkgApiResourceQuantity"),
        ("TrainJob", _set("spec.trainer.numNodes", 2.5),
         "spec.trainer.numNodes: Input should be a valid integer"),
        # missing required fields
        ("TrainJob", _set("spec.runtimeRef", delete=True),
         "spec.runtimeRef: required field of TrainerV1alpha1TrainJobSpec is missing"),
        ("TrainingRuntime", _set(f"{JOBS}.1.name", delete=True),
         f"{JOBS}[1].name: required field of JobsetV1alpha2ReplicatedJob is missing"),
        ("TrainingRuntime", _set(f"{NODE_POD}.containers.0.name", delete=True),
         f"{JOBS}[0].template.spec.template.spec.containers[0].name: required field of "
         "IoK8sApiCoreV1Container is missing"),
        ("TrainJob", _set("apiVersion", "kubeflow.org/v1"), "apiVersion/kind: must be"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " in v else None,
)  # fmt: skip
def test_the_trainer_schema_check_names_the_path_of_what_is_wrong(kind, mutate, error):
    body = trainer_manifests()[f"train, all pod settings: {kind}"]
    assert trainjob_errors(body) == []
    mutate(body)
    errors = trainjob_errors(body)
    assert any(e.startswith(error) or error in e for e in errors), errors
