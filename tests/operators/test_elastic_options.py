"""``HorovodTrainOperator(elastic=ElasticOptions(...))``: what it builds, and what it refuses
(naming why) before any job starts. The elastic runs themselves: tests/engines/test_elastic.py."""

from __future__ import annotations

import pytest

from horovod_airflow.operators import HorovodTrainOperator
from horovod_airflow.operators.exceptions import HorovodConfigError
from horovod_airflow.operators.launchers.kubernetes import KubernetesOptions
from horovod_airflow.operators.launchers.local_options import ElasticOptions, LocalOptions
from tests.operators.helpers import context

HOSTS = ["10.9.0.1:1", "10.9.0.2:1", "10.9.0.3:1"]


def op(
    launcher: str = "local", elastic: ElasticOptions | None = None, **kw
) -> HorovodTrainOperator:
    options = {
        "local": {"local": LocalOptions(hosts=HOSTS, network_interface="eth9")},
        "docker": {"image": "img:1"},
        "kubernetes": {"image": "img:1"},
    }[launcher]
    return HorovodTrainOperator(
        task_id="train",
        launcher=launcher,
        num_proc=kw.pop("num_proc", 3),
        data="s3://b/d",
        output="s3://b/runs/r",
        aws_conn_id=None,
        elastic=elastic or ElasticOptions(min_np=2, max_np=3),
        **{**options, **kw},
    )


def test_min_and_max_np_render_and_reach_horovodrun_with_our_discovery_script() -> None:
    task = op(elastic=ElasticOptions(min_np="{{ params.lo }}", max_np="{{ params.hi }}"))
    ctx = {**context(), "params": {"lo": 2, "hi": 3}}
    task.render_template_fields(ctx)
    spec = task.build_spec(ctx)
    assert spec.elastic is not None and (spec.elastic.min_np, spec.elastic.max_np) == (2, 3)
    assert "--elastic" in spec.argv  # our trainer runs its elastic loop
    launcher = task.make_launcher()
    launcher.check_elastic(spec)  # several hosts, an interface: allowed
    argv = launcher.command(spec)
    assert "-H" not in argv
    at = argv.index("--host-discovery-script")
    script = argv[at + 1]
    assert argv[argv.index("--min-np") + 1] == "2" and argv[argv.index("--max-np") + 1] == "3"
    assert argv[argv.index("--network-interface") + 1] == "eth9"
    import subprocess

    listed = subprocess.run([script], capture_output=True, text=True, check=True).stdout
    assert listed.split() == HOSTS


@pytest.mark.parametrize(
    ("launcher", "kw", "message"),
    [
        ("docker", {}, "one container, one host"),
        (
            "kubernetes",
            {"kubernetes": KubernetesOptions(kubernetes_api="trainjob")},
            "Trainer v2 runs a TrainJob on a fixed number of nodes",
        ),
        ("kubernetes", {"kubernetes": KubernetesOptions(slots_per_worker=3)}, "at least 2 worker"),
        (
            "kubernetes",
            {"kubernetes": KubernetesOptions(slots_per_worker=2), "num_proc": 2},
            "multiple of slots_per_worker=2",
        ),
        (
            "kubernetes",
            {"elastic": ElasticOptions(min_np=2, max_np=3, cooldown_s=(2, 4))},
            r"cooldown_s=\.\.\.\): refused with an MPIJob",
        ),
        ("local", {"local": LocalOptions(hosts="localhost:3")}, "on one host"),
        (
            "local",
            {"elastic": ElasticOptions(min_np=2, max_np=3, cooldown_s=(2, 4))},
            r"cooldown_s=\.\.\.\) needs ElasticOptions.hosts_file",
        ),
        (
            "local",
            {"local": LocalOptions(hosts=HOSTS)},
            "needs LocalOptions.network_interface",
        ),
    ],
)
def test_refused_where_ranks_cannot_come_and_go(launcher: str, kw: dict, message: str) -> None:
    task = op(launcher, **kw)
    spec = task.build_spec(context())
    with pytest.raises(HorovodConfigError, match=message):
        task.make_launcher().check_elastic(spec)


def test_num_proc_outside_min_max_is_refused() -> None:
    task = op(num_proc=3, elastic=ElasticOptions(min_np=2, max_np=2))
    with pytest.raises(HorovodConfigError, match="min_np ≤ num_proc ≤ max_np"):
        task.make_launcher().check_elastic(task.build_spec(context()))


def test_a_completed_elastic_training_is_this_tasks_at_any_world_size() -> None:
    task = op()
    assert task._differences({"world_size": 2}, 3) == []
    plain = HorovodTrainOperator(task_id="t", data="s3://b/d", output="s3://b/o", num_proc=3)
    assert plain._differences({"world_size": 2}, 3) != []


def test_a_cooldown_lets_a_dropped_host_return_and_none_keeps_horovods_default(tmp_path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{h}\n" for h in HOSTS))
    elastic = ElasticOptions(min_np=2, max_np=3, cooldown_s=[5, 60], hosts_file=str(hosts))
    task = op(elastic=elastic)  # cooldown_s as a list: as JSON gives it
    launcher = task.make_launcher()
    spec = task.build_spec(context())
    launcher.check_elastic(spec)
    argv = launcher.command(spec)
    at = argv.index("--blacklist-cooldown-range")
    assert argv[at + 1 : at + 3] == ["5", "60"]
    plain = op()
    assert "--blacklist-cooldown-range" not in plain.make_launcher().command(
        plain.build_spec(context())
    )


@pytest.mark.parametrize("bad", [(0, 10), (10, 5), (1, 3601), (5,), (1.5, 9), (True, 9), "5,9"])
def test_a_cooldown_outside_what_horovodrun_takes_is_refused_naming_the_bounds(bad) -> None:
    with pytest.raises(ValueError) as refused:
        ElasticOptions(min_np=2, max_np=3, cooldown_s=bad)
    assert str(refused.value) == (
        "ElasticOptions.cooldown_s must be (lower, upper) whole seconds with 1 ≤ lower ≤ upper "
        f"≤ 3600 (horovodrun --blacklist-cooldown-range), got {bad!r}"
    )


def test_commit_every_is_one_declaration_for_cli_validation_and_the_form() -> None:
    from horovod_airflow.core.train_config import ConfigError, TrainConfig, param_schema

    schema = param_schema("elastic_commit_every", nullable=True)
    assert schema["minimum"] == 1 and "(20)" in schema["description"]
    with pytest.raises(ConfigError, match="--elastic-commit-every: an integer in"):
        TrainConfig(data="d", output="o", elastic=True, elastic_commit_every=0)
    with pytest.raises(ConfigError, match="--elastic: supported with plain averaging"):
        TrainConfig(data="d", output="o", elastic=True, backward_passes_per_step=2)


def test_an_elastic_mpijob_runs_horovodrun_on_the_operators_discovery_script() -> None:
    """MPIJob: one worker pod per ``slots_per_worker`` ranks up to ``max_np``; horovodrun reads
    the hosts from the MPI Operator's ``/etc/mpi/discover_hosts.sh`` (bare pod names: the
    slots come from ``--slots-per-host``); the pods still get no service-account token."""
    from tests.operators.mpijob_schema import mpijob_errors

    task = op(
        "kubernetes",
        num_proc=4,
        elastic=ElasticOptions(min_np=2, max_np=6, timeout_s=90),
        kubernetes=KubernetesOptions(slots_per_worker=2, namespace="ml"),
    )
    spec = task.build_spec(context())
    launcher = task.make_launcher()
    launcher.check_elastic(spec)
    manifest = launcher.manifest(spec)
    assert mpijob_errors(manifest) == []
    replicas = manifest["spec"]["mpiReplicaSpecs"]
    assert replicas["Worker"]["replicas"] == 3  # max_np / slots_per_worker
    assert manifest["spec"]["slotsPerWorker"] == 2
    (container,) = replicas["Launcher"]["template"]["spec"]["containers"]
    argv = container["command"]
    assert "-H" not in argv
    flags = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flags["--host-discovery-script"] == "/etc/mpi/discover_hosts.sh"
    assert (flags["--min-np"], flags["--max-np"]) == ("2", "6")
    assert argv[argv.index("-np") + 1] == "4"
    assert flags["--slots-per-host"] == "2"
    assert flags["--elastic-timeout"] == "90"
    assert flags["--network-interface"] == "eth0"
    assert "--elastic" in argv  # the trainer's elastic loop
    for role in ("Launcher", "Worker"):
        pod = replicas[role]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pod


def test_an_mpijob_without_elastic_keeps_its_fixed_hosts() -> None:
    task = HorovodTrainOperator(
        task_id="train", launcher="kubernetes", image="img:1", num_proc=2,
        data="s3://b/d", output="s3://b/runs/r", aws_conn_id=None,
        kubernetes=KubernetesOptions(namespace="ml"),
    )  # fmt: skip
    manifest = task.make_launcher().manifest(task.build_spec(context()))
    (container,) = manifest["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"]
    assert "--host-discovery-script" not in container["command"]
    assert container["command"][container["command"].index("-H") + 1].count(":1") == 2


def test_the_elastic_watch_names_lost_ranks_and_hosts_from_horovodruns_own_lines() -> None:
    """Lines as Horovod 0.28's elastic driver prints them at --log-level INFO and at the end
    of a failed job (the engines test shows them on real hosts)."""
    from horovod_airflow.operators.launchers.base import ElasticSpec
    from horovod_airflow.operators.launchers.local_elastic import ElasticWatch

    watch = ElasticWatch()
    for line in [
        "INFO:root:start worker process: 10.0.0.3[0]",
        '[2]<stdout>:{"event": "progress", "step": 3}',
        "INFO:root:record state: 10.0.0.3[0] = FAILURE",
        "INFO:root:blacklist failing host: 10.0.0.3",
        "INFO:root:record state: 10.0.0.3[0] = FAILURE",  # said again: named once
        "horovod.runner.common.util.timeout.TimeoutException: Timed out waiting for {activity}. "
        "Please check that you have enough resources to run at least 3 Horovod processes. "
        "Timeout after 15 seconds.",
        "Process name: 10.0.0.3[0]",
        "Exit code: 255",
    ]:
        watch(line)
    assert watch.describe(ElasticSpec(min_np=3, max_np=3, timeout_s=15)) == (
        "elastic job below min_np=3 for longer than its elastic timeout (15 s); lost rank(s) "
        "10.0.0.3[0] (host[local rank]); host(s) dropped: 10.0.0.3; the first process to "
        "fail: 10.0.0.3[0]"
    )
    quiet = ElasticWatch()
    quiet("[0]<stderr>:ValueError: something else")
    assert quiet.describe(ElasticSpec(min_np=2, max_np=3, timeout_s=15)) == ""  # no lost rank
