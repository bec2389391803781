"""Run the job as a Kubeflow MPIJob (``kubeflow.org/v2beta1``): one launcher pod running
``horovodrun`` over ssh to ``num_proc / slots_per_worker`` worker pods; or, with
``KubernetesOptions(kubernetes_api="trainjob")``, as a Kubeflow Trainer v2 TrainJob of the same
pods.

Both run the trainer image as its user (uid 1000): each worker is the image's sshd on port
2222 (``WORKER_COMMAND``), the MPI Operator mounts the job's key pair in that user's ``~/.ssh``
(``sshAuthMountPath``), and horovodrun connects with ``-p 2222``.

The cluster client comes from the cncf-kubernetes provider's ``KubernetesHook``. Credentials
never appear in the manifest: they go into a Kubernetes Secret (owned by the MPIJob, so it
is garbage-collected with it) that is mounted as the private rank env file
(``HVA_RANK_ENV_FILE``) in every pod; each rank sources it just before it starts (see
``horovod_airflow.operators.command``). Waiting is done by polling here, or — with
``deferrable=True`` — by :class:`horovod_airflow.operators.triggers.MPIJobTrigger`, freeing
the worker slot.

The package, by concern:

- :mod:`.options`: :class:`PodOptions`, :class:`KubernetesOptions` and their validation;
- :mod:`.api`: the Kubeflow resources spoken (:class:`~.api.Resource`, :class:`~.api.Flavour`:
  what differs between MPIJob and TrainJob) and the conditions that end a job;
- :mod:`.manifests`: the pod templates and the MPIJob / TrainingRuntime + TrainJob built from
  them; :mod:`.overrides`: ``mpijob_overrides`` / ``trainjob_overrides`` merged into them;
- :mod:`.client`: the cluster calls for one job's objects, with retries of transient errors;
- :mod:`.pods`: why a job's pods cannot start; :mod:`.logs`: following the launcher pod's log;
- :mod:`.launcher`: :class:`KubernetesLauncher`, which submits, waits, reports and cleans up.
"""

from horovod_airflow.operators.launchers.kubernetes.api import (
    KUBERNETES_APIS,
    mpijob_phase,
    trainjob_phase,
)
from horovod_airflow.operators.launchers.kubernetes.launcher import KubernetesLauncher
from horovod_airflow.operators.launchers.kubernetes.manifests import build_mpijob, build_trainjob
from horovod_airflow.operators.launchers.kubernetes.options import (
    CLEANUP_POLICIES,
    KubernetesOptions,
    PodOptions,
)
from horovod_airflow.operators.launchers.kubernetes.overrides import (
    OWNED_MPIJOB_PATHS,
    OWNED_TRAINJOB_PATHS,
)

__all__ = [
    "CLEANUP_POLICIES",
    "KUBERNETES_APIS",
    "OWNED_MPIJOB_PATHS",
    "OWNED_TRAINJOB_PATHS",
    "KubernetesLauncher",
    "KubernetesOptions",
    "PodOptions",
    "build_mpijob",
    "build_trainjob",
    "mpijob_phase",
    "trainjob_phase",
]
