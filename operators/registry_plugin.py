"""The model registry page in the Airflow UI: an Airflow plugin (``fastapi_apps`` +
``external_views``) registered through the ``airflow.plugins`` entry point.

``/horovod-registry/`` (a page under *Browse* → *Model registry*) lists every model of the
bucket (``HVA_BUCKET``): which version ``latest.json`` names and since when (and who moved it,
why), every published version with its accuracy, dataset, gate decision and reason, the DAG
run that published it, ONNX parity and its training curves, the moves made by hand, and the
runs the gate refused with their ``gate.json`` reason, and the refused candidates (a refused
run's exported model, ``models/<model>/refused/<version>/``) that an admin may promote.
Everything is read through
:mod:`horovod_airflow.operators.model_registry` (the registry's own layout and storage code).

``POST /horovod-registry/api/promote`` (JSON; the page's *Promote* / *Roll back* buttons)
moves ``latest.json`` to a published version by compare-and-swap
(:func:`~horovod_airflow.operators.model_registry.promote.promote_version`) and records the
Asset event serving follows. Airflow's auth manager decides who may:

- reading the page: ``is_authorized_asset(GET)``;
- a move: ``is_authorized_asset(POST)`` on the model's ``<model>_latest`` Asset (the
  permission to create its events: Op and Admin in the simple auth manager);
- an admin override (a version whose gate did not pass, a refused candidate, or one below
  ``HVA_MIN_ACCURACY_FLOOR``): also ``is_authorized_configuration(PUT)``, with its reason
  recorded. A refused candidate's *Promote (admin override)* button is shown to admins only.

A refused request answers 403 (no permission) or 409 (the rules refuse it, or
``latest.json`` changed since the page was read) and changes nothing. The S3 client comes
from the ``HVA_AWS_CONN_ID`` connection (an ``AIRFLOW_CONN_*`` variable works in the API
server), or the ``AWS_*`` environment when that is unset.
"""

from __future__ import annotations

import html
import logging
from typing import Annotated, Any

from airflow.plugins_manager import AirflowPlugin
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from horovod_airflow.core import storage
from horovod_airflow.core.contract import CURVES_NAME, PARITY, PARITY_NAME
from horovod_airflow.operators import settings
from horovod_airflow.operators.exceptions import ChampionChangedError
from horovod_airflow.operators.model_registry.latest import (
    check_version,
    latest_uri,
    read_latest,
)
from horovod_airflow.operators.model_registry.promote import (
    PromotionRefusedError,
    emit_latest_event,
    find_latest_asset,
    list_models,
    list_refused_candidates,
    list_versions,
    promote_version,
    read_history,
    refused_runs,
    version_prefix,
)
from horovod_airflow.operators.model_registry.publish import asset_event_extra
from horovod_airflow.operators.model_registry.refused import candidate_prefix

log = logging.getLogger(__name__)

URL_PREFIX = "/horovod-registry"

app = FastAPI(title="horovod-airflow model registry", docs_url=None, redoc_url=None)


def _client() -> Any | None:
    if not settings.BUCKET_URI.startswith("s3://"):
        return None
    if settings.AWS_CONN_ID:
        from airflow.providers.amazon.aws.hooks.s3 import S3Hook

        return S3Hook(aws_conn_id=settings.AWS_CONN_ID).get_conn()
    return storage.s3_client()


async def _user(request: Request) -> Any:
    from airflow.api_fastapi.core_api.security import get_user

    bearer = None
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        from fastapi.security import HTTPAuthorizationCredentials

        bearer = HTTPAuthorizationCredentials(scheme="Bearer", credentials=auth[7:])
    return await get_user(request, None, bearer)


#: The signed-in user (Airflow's JWT: the UI's cookie or a bearer token). The endpoints are
#: plain functions, so their S3 and database calls run in the thread pool, not the event loop.
User = Annotated[Any, Depends(_user)]


def _can(user: Any, what: str, asset_id: int | None = None) -> bool:
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import AssetDetails

    am = get_auth_manager()
    if what == "read":
        return am.is_authorized_asset(method="GET", user=user)
    details = AssetDetails(id=None if asset_id is None else str(asset_id))
    if what == "move":
        return am.is_authorized_asset(method="POST", user=user, details=details)
    return am.is_authorized_asset(
        method="POST", user=user, details=details
    ) and am.is_authorized_configuration(method="PUT", user=user)


def _name(user: Any) -> str:
    return str(user.get_name())


def _parity(manifest: dict[str, Any], client: Any | None) -> dict[str, Any] | None:
    entry = manifest["files"].get(PARITY_NAME)
    if not entry:
        return None
    return PARITY.loads(storage.read_text(entry["uri"], client=client), entry["uri"])


def registry_view(bucket_uri: str, *, client: Any | None = None) -> dict[str, Any]:
    """What the page shows, as JSON: per model its ``latest.json``, versions (with parity),
    refused candidates (with parity), moves by hand; and the refused runs of the bucket."""
    models = []
    for name in list_models(bucket_uri, client=client):
        latest, _ = read_latest(bucket_uri, name, client=client)
        versions = []
        for manifest in list_versions(bucket_uri, name, client=client):
            versions.append({**manifest, "parity": _parity(manifest, client)})
        candidates = [
            {**manifest, "parity": _parity(manifest, client)}
            for manifest in list_refused_candidates(bucket_uri, name, client=client)
        ]
        models.append(
            {
                "model": name,
                "latest": latest,
                "versions": versions,
                "refused_candidates": candidates,
                "history": read_history(bucket_uri, name, client=client),
            }
        )
    refused = [
        {"run_uri": r.run_uri, "decided_at": r.decided_at.isoformat(), "gate": r.gate}
        for r in refused_runs(bucket_uri, client=client)
    ]
    return {"bucket_uri": bucket_uri, "models": models, "refused_runs": refused}


@app.get("/api/registry")
def api_registry(user: User) -> JSONResponse:
    if not _can(user, "read"):
        raise HTTPException(403, f"{_name(user)} may not read assets")
    return JSONResponse(registry_view(settings.BUCKET_URI, client=_client()))


@app.get("/curves/{model}/{version}")
def curves(model: str, version: str, user: User) -> Response:
    if not _can(user, "read"):
        raise HTTPException(403, f"{_name(user)} may not read assets")
    try:
        uri = storage.join(
            version_prefix(settings.BUCKET_URI, safe_name(model), version), CURVES_NAME
        )
    except ValueError as e:
        raise HTTPException(400, str(e)) from e
    return Response(storage.read_bytes(uri, client=_client()), media_type="image/png")


@app.get("/curves/{model}/refused/{version}")
def candidate_curves(model: str, version: str, user: User) -> Response:
    if not _can(user, "read"):
        raise HTTPException(403, f"{_name(user)} may not read assets")
    try:
        uri = storage.join(candidate_prefix(settings.BUCKET_URI, safe_name(model), version),
                           CURVES_NAME)  # fmt: skip
    except ValueError as e:
        raise HTTPException(400, str(e)) from e
    return Response(storage.read_bytes(uri, client=_client()), media_type="image/png")


def safe_name(model: str) -> str:
    """A model name as a registry key segment (the same rule as a version name)."""
    return check_version(model)


@app.post("/api/promote")
def api_promote(request: Request, body: dict[str, Any], user: User) -> JSONResponse:
    """Body ``{"model", "version", "reason", "override_reason"?}``; JSON only (a cross-site
    form cannot send it)."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/json":
        raise HTTPException(415, "send the request as application/json")
    try:
        model = safe_name(body["model"])
        version = check_version(body["version"])
        reason = str(body.get("reason") or "")
        override_reason = body.get("override_reason") or None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise HTTPException(400, f"need model, version and reason: {e}") from e
    uri = latest_uri(settings.BUCKET_URI, model)
    try:
        asset_id = find_latest_asset(model, uri)
    except LookupError as e:
        raise HTTPException(409, str(e)) from e
    if not _can(user, "move", asset_id):
        log.warning("%s may not move %s latest.json (refused)", _name(user), model)
        raise HTTPException(
            403,
            f"{_name(user)} may not move {model}'s latest.json: that needs the permission to "
            "create events on its Asset. Nothing changed",
        )
    admin = _can(user, "override", asset_id)
    if override_reason and not admin:
        raise HTTPException(
            403,
            f"{_name(user)} may not override the gate or the floors (needs the permission to "
            "change the configuration too). Nothing changed",
        )
    try:
        latest, record = promote_version(
            bucket_uri=settings.BUCKET_URI,
            model_name=model,
            version=version,
            actor=_name(user),
            reason=reason,
            min_accuracy_floor=settings.MIN_ACCURACY_FLOOR,
            admin=admin,
            override_reason=override_reason,
            client=_client(),
        )
    except (PromotionRefusedError, ChampionChangedError) as e:
        raise HTTPException(409, str(e)) from e
    event = None
    if record is not None:
        emitted = emit_latest_event(model, uri, asset_event_extra(latest))
        event = getattr(emitted, "id", None)
    return JSONResponse({"latest": latest, "promotion": record, "asset_event_id": event})


def _pct(value: Any) -> str:
    return f"{100 * value:.2f} %" if isinstance(value, int | float) else "—"


def _e(value: Any) -> str:
    return html.escape("—" if value is None else str(value))


def _parity_cell(parity: dict[str, Any]) -> str:
    return (
        f"<td>{'ok' if parity.get('passed') else 'failed'}, max |Δ| "
        f"{_e(parity.get('max_abs_diff'))}, {_e(parity.get('argmax_mismatches'))} "
        f"argmax mismatches / {_e(parity.get('samples'))}</td>"
    )


def render_page(
    view: dict[str, Any], *, user: str, may_move: bool, may_override: bool = False
) -> str:
    """The registry page (HTML) of :func:`registry_view`."""
    parts = [
        "<h1>Model registry</h1>",
        f"<p>Bucket <code>{_e(view['bucket_uri'])}</code> · signed in as <b>{_e(user)}</b>"
        + ("" if may_move else " (read only: no permission to move latest.json)")
        + "</p><p id='message' role='status'></p>",
    ]
    for m in view["models"]:
        name, latest = m["model"], m["latest"] or {}
        since = latest.get("since") or latest.get("published_at")
        moved = latest.get("promotion")
        parts.append(
            f"<section class='model' data-model='{_e(name)}'><h2>{_e(name)}</h2>"
            f"<p class='latest'>latest: <b data-latest='{_e(latest.get('version'))}'>"
            f"{_e(latest.get('version'))}</b> since {_e(since)}"
            + (
                f" — {_e(moved['action'])} by {_e(moved['actor'])}: {_e(moved['reason'])}"
                + (
                    f" (admin override: {_e(moved.get('override_reason'))})"
                    if moved["override"]
                    else ""
                )
                if moved
                else ""
            )
            + "</p>"
        )
        parts.append(
            "<table class='versions'><tr><th>version</th><th>accuracy</th><th>dataset</th>"
            "<th>gate</th><th>published by</th><th>parity</th><th>curves</th><th></th></tr>"
        )
        for v in m["versions"]:
            gate, parity = v.get("gate") or {}, v.get("parity") or {}
            is_latest = v["version"] == latest.get("version")
            content = str(v["dataset"].get("content_hash") or "")[:16]
            button = ""
            if may_move and not is_latest:
                label = "Roll back" if v["version"] < str(latest.get("version", "")) else "Promote"
                button = f"<button class='move' data-version='{_e(v['version'])}'>{label}</button>"
            parts.append(
                f"<tr class='version{' latest' if is_latest else ''}' "
                f"data-version='{_e(v['version'])}'>"
                f"<td>{_e(v['version'])}{' ★ latest' if is_latest else ''}</td>"
                f"<td class='accuracy'>{_pct(v['metrics'].get('val_accuracy'))}</td>"
                f"<td><code>{_e(v['dataset'].get('uri'))}</code> {_e(content)}</td>"
                f"<td class='gate'>{'passed' if gate.get('passed') else 'refused'}: "
                f"{_e(gate.get('reason'))}</td>"
                f"<td>{_e(v.get('dag_run_id'))}<br>{_e(v.get('published_at'))}</td>"
                + _parity_cell(parity)
                + f"<td><a href='{URL_PREFIX}/curves/{_e(name)}/{_e(v['version'])}'>"
                f"<img alt='curves' width='220' "
                f"src='{URL_PREFIX}/curves/{_e(name)}/{_e(v['version'])}'></a></td>"
                f"<td>{button}</td></tr>"
            )
        parts.append("</table>")
        if m.get("refused_candidates"):
            parts.append(
                "<h3>Refused candidates</h3><p>Models the gate refused, kept where serving "
                "never looks; promoting one needs an admin override with its reason.</p>"
                "<table class='candidates'><tr><th>version</th><th>accuracy</th><th>dataset</th>"
                "<th>gate (refused)</th><th>run</th><th>parity</th><th>curves</th><th></th></tr>"
            )
            for c in m["refused_candidates"]:
                gate, version = c.get("gate") or {}, c["version"]
                curves = f"{URL_PREFIX}/curves/{_e(name)}/refused/{_e(version)}"
                button = (
                    f"<button class='move' data-version='{_e(version)}'>"
                    "Promote (admin override)</button>"
                    if may_move and may_override
                    else ""
                )
                parts.append(
                    f"<tr class='candidate' data-version='{_e(version)}'><td>{_e(version)}</td>"
                    f"<td class='accuracy'>{_pct(c['metrics'].get('val_accuracy'))}</td>"
                    f"<td><code>{_e(c['dataset'].get('uri'))}</code></td>"
                    f"<td class='gate'>refused: {_e(gate.get('reason'))}</td>"
                    f"<td>{_e(c.get('dag_run_id'))}<br>{_e(c.get('published_at'))}</td>"
                    + _parity_cell(c.get("parity") or {})
                    + f"<td><a href='{curves}'><img alt='curves' width='220' src='{curves}'></a>"
                    f"</td><td>{button}</td></tr>"
                )
            parts.append("</table>")
        if may_move:
            parts.append(
                "<p>Why (recorded): <input class='reason' size='50'> Admin override reason "
                "(a refused version or one below the floor only): "
                "<input class='override' size='40'></p>"
            )
        if m["history"]:
            parts.append("<h3>Moves by hand</h3><ul class='history'>")
            for h in m["history"]:
                parts.append(
                    f"<li>{_e(h['at'])}: {_e(h['action'])} {_e(h['previous_version'])} → "
                    f"{_e(h['version'])} by {_e(h['actor'])} — {_e(h['reason'])}"
                    + (f" (override: {_e(h.get('override_reason'))})" if h["override"] else "")
                    + "</li>"
                )
            parts.append("</ul>")
        parts.append("</section>")
    parts.append(
        "<h2>Refused runs</h2><table class='refused'><tr><th>run</th><th>decided</th>"
        "<th>accuracy</th><th>reason (gate.json)</th></tr>"
    )
    for r in view["refused_runs"]:
        parts.append(
            f"<tr><td><code>{_e(r['run_uri'])}</code></td><td>{_e(r['decided_at'])}</td>"
            f"<td>{_pct(r['gate'].get('challenger_accuracy'))}</td>"
            f"<td>{_e(r['gate'].get('reason'))}</td></tr>"
        )
    parts.append("</table>")
    return _PAGE.replace("{{BODY}}", "\n".join(parts)).replace("{{PREFIX}}", URL_PREFIX)


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>Model registry</title>
<style>body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:4px 8px;vertical-align:top;font-size:13px}
tr.latest{background:#e8f6e8}#message{font-weight:bold}</style></head><body>
{{BODY}}
<script>
for (const b of document.querySelectorAll('button.move')) {
  b.onclick = async () => {
    const model = b.closest('section').dataset.model, version = b.dataset.version;
    const section = b.closest('section');
    const reason = section.querySelector('input.reason').value;
    const override = section.querySelector('input.override').value || null;
    const r = await fetch('{{PREFIX}}/api/promote', {method: 'POST',
      headers: {'Content-Type': 'application/json'}, credentials: 'same-origin',
      body: JSON.stringify({model, version, reason, override_reason: override})});
    const body = await r.json();
    const m = document.getElementById('message');
    m.dataset.status = r.status;
    m.textContent = r.ok ? `latest.json now names ${body.latest.version} (reload to see it)`
      : `refused (${r.status}): ${body.detail}`;
  };
}
</script></body></html>"""


@app.get("/", response_class=HTMLResponse)
def page(user: User) -> HTMLResponse:
    if not _can(user, "read"):
        raise HTTPException(403, f"{_name(user)} may not read assets")
    view = registry_view(settings.BUCKET_URI, client=_client())
    return HTMLResponse(
        render_page(
            view,
            user=_name(user),
            may_move=_can(user, "move"),
            may_override=_can(user, "override"),
        )
    )


class RegistryPlugin(AirflowPlugin):
    """The registry page and its API in the Airflow UI (see the module docstring)."""

    name = "horovod_airflow_registry"
    fastapi_apps = [  # noqa: RUF012 (the AirflowPlugin API)
        {"app": app, "url_prefix": URL_PREFIX, "name": "horovod-airflow registry"}
    ]
    external_views = [  # noqa: RUF012 (the AirflowPlugin API)
        {
            "name": "Model registry",
            "href": URL_PREFIX + "/",
            "destination": "nav",
            "category": "browse",
            "url_route": "model-registry",
        }
    ]
