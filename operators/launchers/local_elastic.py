"""Elastic Horovod for ``launcher="local"``: the checks that refuse what cannot work, the
discovery script over a hosts file, and the horovodrun arguments (``--min-np``, ``--max-np``,
``--host-discovery-script``, ``--elastic-timeout``)."""

from __future__ import annotations

import shlex
import tempfile
from collections.abc import Sequence
from pathlib import Path

from horovod_airflow.operators.command import Host
from horovod_airflow.operators.exceptions import HorovodConfigError
from horovod_airflow.operators.launchers.base import (
    ElasticSpec,
    check_elastic_bounds,
    elastic_args,
)
from horovod_airflow.operators.launchers.local_options import ElasticOptions, LocalOptions


def check_local_elastic(
    elastic: ElasticSpec, hosts: Sequence[Host], num_proc: int, options: LocalOptions
) -> None:
    """Raise :class:`HorovodConfigError` naming why this elastic job cannot run here."""
    if len({h.name for h in hosts}) < 2 or all(h.is_local for h in hosts):
        raise HorovodConfigError(
            f"elastic=ElasticOptions(...): hosts {','.join(map(str, hosts))!r} put every rank "
            f"on one host; Horovod drops a whole host when one of its ranks fails, so a lost "
            f"rank would end the job all the same. List several hosts in LocalOptions.hosts "
            f"(or ElasticOptions.hosts_file)"
        )
    if not options.network_interface:
        raise HorovodConfigError(
            "elastic=ElasticOptions(...) needs LocalOptions.network_interface (the interface "
            "every host and this worker share): without it horovodrun's elastic driver prints "
            "the discovered slots and then waits without starting a worker"
        )
    check_elastic_bounds(elastic, num_proc)


def discovery_script(hosts: Sequence[Host], hosts_file: str | None) -> Path:
    """A host-discovery script that prints the ``host:slots`` lines of ``hosts_file`` each
    time horovodrun runs it (written from ``hosts`` when no file is given)."""
    folder = Path(tempfile.mkdtemp(prefix="hva-elastic-"))
    if hosts_file is None:
        listed = folder / "hosts"
        listed.write_text("".join(f"{h}\n" for h in hosts))
        hosts_file = str(listed)
    script = folder / "discover_hosts.sh"
    script.write_text(f"#!/bin/sh\nexec grep -v '^#' {shlex.quote(hosts_file)}\n")
    script.chmod(0o700)
    return script


__all__ = ["ElasticOptions", "check_local_elastic", "discovery_script", "elastic_args"]
