"""Run the whole retraining DAG once on embedded defaults and print what it produced.

    scripts/run_pipeline.sh [--num-proc 2] [--epochs N] [--max-train-samples N]
                            [--min-accuracy 0.98] [--conf '{"lr": 0.01}'] [--out .runs/pipeline]
                            [--s3 seaweedfs|moto]

Embedded defaults: a real S3 server (SeaweedFS) on 127.0.0.1 keeping its data in
``<out>/s3`` with two identities, the worker's (connection ``aws_default``) and the training
ranks' (``hva_ranks``: read datasets, read/write runs, nothing under ``models/``); SQLite
Airflow metadata in ``<out>/airflow``; the local launcher with 2 CPU ranks; the vendored
real MNIST. The DAG runs through ``dag.test()`` (a real Airflow run, every task executed);
the published model and its files are copied to ``<out>/published/``. The bucket outlives
the run: a second run with the same ``--out`` gates against the model the first published
(``rm -rf <out>`` starts afresh). ``--s3 moto`` runs on moto's server instead (no
credentials checked, nothing kept), to compare the two.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.devstack import (  # noqa: E402  (needs the repo root on sys.path)
    RANKS_CONN_ID,
    DbMigrate,
    airflow_env,
    embedded_s3,
    venv_and_repo_on_path,
)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-proc", type=int, default=2, help="Horovod ranks (default 2)")
    p.add_argument("--epochs", type=int, default=None, help="default: the trainer's")
    p.add_argument("--max-train-samples", type=int, default=None, help="train on a subset")
    p.add_argument("--min-accuracy", type=float, default=None, help="gate floor (0-1)")
    p.add_argument("--conf", default="{}", help="extra DAG run conf as JSON (the form's fields)")
    p.add_argument("--out", type=Path, default=REPO / ".runs" / "pipeline", help="work folder")
    p.add_argument(
        "--s3",
        choices=("seaweedfs", "moto"),
        default="seaweedfs",
        help="the embedded S3 server (default seaweedfs: checks credentials, keeps <out>/s3)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        conf = json.loads(args.conf)
    except json.JSONDecodeError as e:
        print(f"run_pipeline: --conf is not valid JSON: {e}", file=sys.stderr)
        return 2
    conf.setdefault("num_proc", args.num_proc)
    for key in ("epochs", "max_train_samples", "min_accuracy"):
        if getattr(args, key) is not None:
            conf[key] = getattr(args, key)

    out = args.out.resolve()
    home = out / "airflow"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.update(airflow_env(home))
    venv_and_repo_on_path()

    start = time.monotonic()
    with embedded_s3(args.s3, out / "s3") as s3:
        print(
            f"run_pipeline: embedded S3 ({args.s3}) on {s3.endpoint}, up in "
            f"{time.monotonic() - start:.1f}s; Airflow home {home}"
        )
        bucket = os.environ.get("HVA_BUCKET", "horovod-airflow")
        with contextlib.suppress(Exception):  # kept from an earlier run with this --out
            s3.client().create_bucket(Bucket=bucket)
        if s3.ranks is not None:  # the ranks run as their own, narrower identity
            s3.grant_ranks(bucket)
            os.environ.setdefault("HVA_RANK_AWS_CONN_ID", RANKS_CONN_ID)
        migrate = DbMigrate()
        _start_execution_api()  # meanwhile: both take seconds, the cores are otherwise idle
        migrate.wait()
        return _run(conf, out)


def _start_execution_api() -> None:
    """Build the in-process Execution API that ``dag.test()`` runs every task through.

    In a deployment the API server is up before any run starts; ``dag.test()`` builds its
    in-process stand-in (imports, the FastAPI app, its event-loop thread, and on the first
    request the app's start-up) when the first task starts: ~6 s inside the DAG run on 2
    cores. Built and asked for its health here once, and reused by ``dag.test()`` (Airflow
    caches it per process), it stays out of the run's time."""
    import httpx
    from airflow.sdk.execution_time.supervisor import in_process_api_server

    api = in_process_api_server()
    health = httpx.Client(transport=api.transport, base_url="http://in-process").get("/health")
    health.raise_for_status()


def _run(conf: dict, out: Path) -> int:
    from airflow.sdk import DagRunState

    from dags.mnist_horovod_retrain import retrain_dag
    from horovod_airflow.apps.mnist import MNIST
    from horovod_airflow.core import storage
    from horovod_airflow.core.contract import GATE, GATE_NAME, LATEST_NAME, METRICS, METRICS_NAME
    from horovod_airflow.operators.model_registry import read_champion
    from horovod_airflow.operators.settings import BUCKET_URI

    dag = retrain_dag
    start = time.monotonic()
    dag_run = dag.test(run_conf=conf)
    wall = time.monotonic() - start
    states = {ti.task_id: ti.state for ti in dag_run.get_task_instances()}
    print(f"\nrun_pipeline: DAG run {dag_run.run_id} ended {dag_run.state} in {wall:.0f}s")
    for task_id, state in states.items():
        print(f"  {task_id:15s} {state}")

    client = storage.s3_client()
    run_prefix = f"{BUCKET_URI}/runs/{dag.dag_id}/"
    metrics_uris = [u for u in storage.list_uris(run_prefix, client=client)
                    if u.endswith("/" + METRICS_NAME)]  # fmt: skip
    if metrics_uris:
        metrics = METRICS.loads(
            storage.read_text(metrics_uris[-1], client=client), metrics_uris[-1]
        )
        print(
            f"\naccuracy (allreduced over {metrics['world_size']} ranks): "
            f"{metrics['val_accuracy']:.4%} ({metrics['val_correct']}/{metrics['val_samples']}) "
            f"after {metrics['epochs']} epochs, {metrics['train_seconds']:.0f}s of training"
        )
        gate_uri = storage.join(metrics_uris[-1].rsplit("/", 1)[0], GATE_NAME)
        if storage.exists(gate_uri, client=client):
            gate = GATE.loads(storage.read_text(gate_uri, client=client), gate_uri)
            print(f"gate: {'PASSED' if gate['passed'] else 'FAILED'} — {gate['reason']}")
    latest = read_champion(BUCKET_URI, MNIST.model_name, client=client)
    if latest:
        dest = out / "published" / latest["version"]
        for uri in storage.list_uris(latest["uri"], client=client):
            storage.download_file(uri, dest / uri.rsplit("/", 1)[-1], client=client)
        # a faithful copy of the document read (not re-stamped)
        storage.write_text(str(out / "published" / LATEST_NAME), json.dumps(latest, indent=2))
        print(f"model: {latest['onnx_uri']} (version {latest['version']})")
        print(f"copied to {dest}/ (model.onnx, summary.md, training_curves.png, manifest.json)")
    else:
        print("model: nothing published (gate failed or a task failed); serving is untouched")
    ok = dag_run.state == DagRunState.SUCCESS
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
