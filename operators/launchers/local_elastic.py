"""Elastic Horovod for ``launcher="local"``: the checks that refuse what cannot work, the
discovery script over a hosts file, and the horovodrun arguments (``--min-np``, ``--max-np``,
``--host-discovery-script``, ``--elastic-timeout``)."""

from __future__ import annotations

import re
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
    if elastic.cooldown_s is not None and elastic.hosts_file is None:
        raise HorovodConfigError(
            "elastic=ElasticOptions(cooldown_s=...) needs ElasticOptions.hosts_file, kept to "
            "the hosts that are up: the discovery script over LocalOptions.hosts lists a lost "
            "host forever, so its cooldown would end with horovodrun starting a rank there; "
            "that rank fails, and Horovod 0.28.1 then ends the whole job once Gloo's 30 s "
            "rendezvous timeout passes (measured here with a host's namespace torn down)"
        )


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


#: horovodrun's elastic driver at ``--log-level INFO`` (Horovod 0.28: runner/elastic/
#: discovery.py and registration.py), and its end of a failed job (gloo_run.py, timeout.py).
_BLACKLISTED = re.compile(r"blacklist failing host: (\S+)")
_FAILED_SLOT = re.compile(r"record state: (\S+)\[(\d+)\] = FAILURE")
_FIRST_FAILED = re.compile(r"Process name: (\S+)\[(\d+)\]")
_BELOW_MIN = re.compile(r"at least (\d+) Horovod processes\. Timeout after (\d+) seconds")


class ElasticWatch:
    """Reads an elastic job's output line by line (its tail may have scrolled past them) for
    what horovodrun's driver says about lost ranks and hosts, so that a failed job's error
    names them (:meth:`describe`)."""

    def __init__(self) -> None:
        self.failed: list[str] = []  # host[local rank], in the order they failed
        self.blacklisted: list[str] = []
        self.first: str | None = None
        self.below_min: tuple[int, int] | None = None  # (min_np, seconds waited)

    def __call__(self, line: str) -> None:
        if found := _FAILED_SLOT.search(line):
            slot = f"{found.group(1)}[{found.group(2)}]"
            if slot not in self.failed:
                self.failed.append(slot)
        elif found := _BLACKLISTED.search(line):
            if found.group(1) not in self.blacklisted:
                self.blacklisted.append(found.group(1))
        elif found := _FIRST_FAILED.search(line):
            self.first = f"{found.group(1)}[{found.group(2)}]"
        elif found := _BELOW_MIN.search(line):
            self.below_min = (int(found.group(1)), int(found.group(2)))

    def describe(self, elastic: ElasticSpec) -> str:
        """``elastic job below min_np=3 for longer than its elastic timeout (15 s); lost
        rank(s) h3[0] (host[local rank]); host(s) dropped: h3; …``; "" when the output said
        nothing of lost ranks (the job failed for another reason)."""
        lost = self.failed or ([self.first] if self.first else [])
        if not (lost or self.blacklisted or self.below_min):
            return ""
        if self.below_min is not None:
            head = (
                f"elastic job below min_np={self.below_min[0]} for longer than its elastic "
                f"timeout ({self.below_min[1]} s)"
            )
        else:
            head = f"elastic job (min_np={elastic.min_np}, max_np={elastic.max_np}) failed"
        parts = [head]
        if lost:
            parts.append(f"lost rank(s) {', '.join(lost)} (host[local rank])")
        if self.blacklisted:
            parts.append(f"host(s) dropped: {', '.join(self.blacklisted)}")
        if self.first:
            parts.append(f"the first process to fail: {self.first}")
        return "; ".join(parts)


__all__ = [
    "ElasticOptions",
    "ElasticWatch",
    "check_local_elastic",
    "discovery_script",
    "elastic_args",
]
