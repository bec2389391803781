"""``python -m horovod_airflow.operators.model_registry``: list a model's published versions,
its refused candidates and its moves by hand; promote or roll back ``latest.json`` to a
published version or a refused candidate (a compare-and-swap, recorded with who and why, then
the Asset event serving follows).

Run it where the ``airflow`` CLI runs (it records the Asset event in Airflow's metadata
database) with the bucket's credentials in the AWS environment (``AWS_*``, as the
``horovod_airflow.core.storage`` client reads them). Whoever holds those credentials may move
``latest.json``; a version whose gate did not pass (a refused candidate among them) or that
is below the deployment floor (``HVA_MIN_ACCURACY_FLOOR``) also needs ``--override REASON``,
which is recorded. The
registry page in the Airflow UI asks the auth manager instead.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from typing import Any

from horovod_airflow.operators.exceptions import ChampionChangedError
from horovod_airflow.operators.model_registry.latest import latest_uri, read_latest
from horovod_airflow.operators.model_registry.promote import (
    PromotionRefusedError,
    emit_latest_event,
    find_latest_asset,
    list_refused_candidates,
    list_versions,
    promote_version,
    read_history,
)
from horovod_airflow.operators.model_registry.publish import asset_event_extra


def _parser() -> argparse.ArgumentParser:
    from horovod_airflow.operators import settings

    p = argparse.ArgumentParser(
        prog="python -m horovod_airflow.operators.model_registry",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--bucket-uri", default=settings.BUCKET_URI, help="default: %(default)s")
    sub = p.add_subparsers(dest="command", required=True)
    ls = sub.add_parser(
        "list", help="published versions (JSON), latest, refused candidates, the moves by hand"
    )
    ls.add_argument("model")
    pr = sub.add_parser(
        "promote", help="point latest.json at a published version or refused candidate (CAS)"
    )
    pr.add_argument("model")
    pr.add_argument("version")
    pr.add_argument("--reason", required=True, help="why: recorded in the version history")
    pr.add_argument("--actor", default=None, help="who (recorded); default: the login name")
    pr.add_argument(
        "--override",
        metavar="REASON",
        default=None,
        help="admin override for a version whose gate did not pass or below the floor",
    )
    pr.add_argument(
        "--min-accuracy-floor",
        type=float,
        default=settings.MIN_ACCURACY_FLOOR,
        help="the deployment floor (HVA_MIN_ACCURACY_FLOOR; default: %(default)s)",
    )
    return p


def _answer_stream() -> Any:
    """Where the answer (JSON) goes: the process's stdout, kept aside, while file descriptor 1
    is pointed at stderr, so whatever Airflow's logging writes to stdout lands on stderr."""
    sys.stdout.flush()
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return answer


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    answer = _answer_stream()
    out: dict[str, Any]
    if args.command == "list":
        latest, _ = read_latest(args.bucket_uri, args.model)
        out = {
            "latest": latest,
            "versions": list_versions(args.bucket_uri, args.model),
            "refused_candidates": list_refused_candidates(args.bucket_uri, args.model),
            "history": read_history(args.bucket_uri, args.model),
        }
        print(json.dumps(out, indent=2), file=answer, flush=True)
        return 0
    uri = latest_uri(args.bucket_uri, args.model)
    try:
        find_latest_asset(args.model, uri)
        latest, record = promote_version(
            bucket_uri=args.bucket_uri,
            model_name=args.model,
            version=args.version,
            actor=args.actor or getpass.getuser(),
            reason=args.reason,
            min_accuracy_floor=args.min_accuracy_floor,
            admin=args.override is not None,
            override_reason=args.override,
        )
    except (PromotionRefusedError, ChampionChangedError, LookupError) as e:
        print(f"model_registry: ERROR: {e}", file=sys.stderr)
        return 3
    if record is not None:
        emit_latest_event(args.model, uri, asset_event_extra(latest))
    print(json.dumps({"latest": latest, "promotion": record}, indent=2), file=answer, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
