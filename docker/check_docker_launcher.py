"""Preflight of the docker launcher, run once by the compose stack before the scheduler starts.

LocalExecutor runs tasks inside the scheduler container, and the docker launcher starts each
training run as a sibling container through the host's Docker socket. This checks, as the same
user and groups as the scheduler, that the socket answers, that the trainer image exists and that
the network the trainer must join (the training network, where the object store is
``seaweedfs``) exists, and names the fix when not.

    python check_docker_launcher.py      # reads DOCKER_HOST, HVA_TRAINER_IMAGE, HVA_DOCKER_NETWORK
"""

from __future__ import annotations

import os
import sys


def check(env: dict[str, str]) -> list[str]:
    """Problems found, each a sentence naming what is wrong and the fix; empty when all is well."""
    url = env.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    image = env.get("HVA_TRAINER_IMAGE", "")
    network = env.get("HVA_DOCKER_NETWORK", "")
    if not image:
        return ["HVA_TRAINER_IMAGE is not set: set it in .env (see .env.example)"]
    import docker  # the docker provider's own dependency, in the Airflow image

    try:
        client = docker.DockerClient(base_url=url, timeout=10)
        client.ping()
    except Exception as exc:
        return [
            f"cannot reach the Docker engine at {url} as uid {os.getuid()} "
            f"(groups {sorted(os.getgroups())}): {exc}. Mount the host's Docker socket there "
            "and set DOCKER_GID in .env to the socket's group: stat -c %g /var/run/docker.sock"
        ]
    problems = []
    try:
        client.images.get(image)
    except Exception as exc:
        problems.append(
            f"trainer image {image!r} is not on the Docker engine ({exc}): "
            "build it with `docker compose build trainer`"
        )
    if network:
        try:
            client.networks.get(network)
        except Exception as exc:
            problems.append(
                f"Docker network {network!r} does not exist ({exc}): HVA_DOCKER_NETWORK must name "
                "the compose stack's network (networks.default.name in docker-compose.yml)"
            )
    return problems


def main() -> int:
    problems = check(dict(os.environ))
    for problem in problems:
        print(f"check_docker_launcher: ERROR: {problem}", file=sys.stderr)
    if not problems:
        print("check_docker_launcher: Docker engine, trainer image and network are ready")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
