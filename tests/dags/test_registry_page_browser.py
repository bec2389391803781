"""The registry page as people use it: ``airflow standalone`` (API server with the plugin
loaded from the package's entry point, scheduler, DAG processor) on the serving DAG, the real
S3 server, and a real browser (Debian's headless chromium through selenium).

Two real (nearest-centroid ONNX) models are published through the registry, a run the gate
refused leaves its ``gate.json``, and another refused run's model is kept as a refused
candidate (V3). A viewer sees every version with its figures, the refused run's reason and
the refused candidate with its reason, has no buttons, and a promote (of V1 or of V3) sent with a
viewer's session is refused (403) with ``latest.json`` unchanged. An admin rolls back from
the page to V1, below the deployment floor (set between the two): refused (409) without an
override reason, nothing changed; with one, ``latest.json`` changes by compare-and-swap, the
move is recorded with who, why and the override, and the serving DAG runs on the Asset event
and serves V1. Then the admin promotes the refused candidate V3: refused (409) without an
override reason, nothing published; with one, V3 is published to the registry,
``latest.json`` names it (the move recorded with the override), and serving runs on the
event and serves V3. The page's screenshot is saved in the test's folder, and into docs/
with ``HVA_UPDATE_DOCS_SCREENSHOTS=1``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from horovod_airflow.core import layout, storage
from horovod_airflow.core.contract import GATE
from horovod_airflow.operators.model_registry import read_latest
from horovod_airflow.operators.model_registry.promote import (
    list_versions,
    read_history,
    read_version,
)
from horovod_airflow.operators.model_registry.refused import read_candidate
from horovod_airflow.operators.staging import stage_dataset
from tests.browser import headless_chromium
from tests.conftest import REPO
from tests.operators.helpers import publish_centroid_model, refused_centroid_candidate
from tests.standalone import Standalone

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SERVE = "mnist_serve_latest_model"
V1 = "v20261201T000000Z-aaaaaaaaaaaa"
V2 = "v20261202T000000Z-bbbbbbbbbbbb"
V3 = "v20261203T000000Z-cccccccccccc"  # a refused run's candidate
PAGE = "/horovod-registry/"


@pytest.fixture
def browser() -> Iterator[Any]:
    with headless_chromium(window="1500,1100", implicit_wait=10) as driver:
        yield driver


def _registry(s3_server, mnist_subset) -> str:
    """V1 (trained on a tenth of the images) and V2 (all of them) published, one refused run,
    and V3 (half of the images) a refused candidate."""
    s3 = s3_server.client()
    bucket = s3_server.new_bucket("registry-ui")
    info = stage_dataset(str(mnist_subset), f"s3://{bucket}", client=s3)
    files = layout.find_source_files(mnist_subset)
    images, labels = (layout.read_idx(files[("train", k)]) for k in ("images", "labels"))
    test = tuple(layout.read_idx(files[("test", k)]) for k in ("images", "labels"))
    publish_centroid_model(s3, bucket, info, (images[:200], labels[:200]), test, version=V1,
                           dag_run_id="manual__v1")  # fmt: skip
    publish_centroid_model(s3, bucket, info, (images, labels), test, version=V2,
                           dag_run_id="manual__v2")  # fmt: skip
    refused = {"passed": False, "reason": "below the floor 98.0000%", "challenger_accuracy": 0.5,
               "min_accuracy": 0.98, "max_regression": 0.01}  # fmt: skip
    storage.write_text(f"s3://{bucket}/runs/mnist_horovod_retrain/manual__x/gate.json",
                       GATE.dumps(refused), client=s3)  # fmt: skip
    refused_centroid_candidate(s3, bucket, info, (images[:1000], labels[:1000]), test,
                               version=V3, dag_run_id="scheduled__v3",
                               reason="accuracy below the floor 99.0000%")  # fmt: skip
    return bucket


def _token(airflow: Standalone, user: str) -> str:
    passwords = json.loads(
        (airflow.home / "simple_auth_manager_passwords.json.generated").read_text()
    )
    answer = airflow._request(
        "POST", "/auth/token", {"username": user, "password": passwords[user]}
    )
    return str(answer["access_token"])


def _sign_in(driver: Any, airflow: Standalone, user: str) -> None:
    driver.get(airflow.base + "/api/v2/version")  # the origin, to set its cookie
    driver.delete_all_cookies()
    driver.add_cookie({"name": "_token", "value": _token(airflow, user), "path": "/"})
    driver.get(airflow.base + PAGE)


def _promote_as(driver: Any, version: str, override: str | None = None) -> tuple[int, dict]:
    """POST the promote API from the page with the signed-in user's session (the cookie)."""
    answer = driver.execute_async_script(
        """const done = arguments[arguments.length - 1];
        fetch('/horovod-registry/api/promote', {method: 'POST', credentials: 'same-origin',
          headers: {'Content-Type': 'application/json'},
          body: JSON.stringify({model: 'mnist_cnn', version: arguments[0], reason: 'try',
                                override_reason: arguments[1]})})
        .then(async r => done([r.status, await r.json()]));""",
        version,
        override,
    )
    return int(answer[0]), answer[1]


def _served(airflow: Standalone, count: int) -> list[dict] | None:
    """The serving DAG's runs on Asset events, newest first, once ``count`` of them ended."""
    runs = airflow.call("GET", f"/api/v2/dags/{SERVE}/dagRuns")["dag_runs"]
    done = sorted((r for r in runs if r["run_type"] == "asset_triggered"),
                  key=lambda r: r["run_after"], reverse=True)  # fmt: skip
    ended = [r for r in done if r["state"] in ("success", "failed")]
    return done if len(ended) >= count and len(done) == len(ended) else None


def _served_version(airflow: Standalone, run: dict) -> str:
    """The version a serving run served (its XCom), after checking it succeeded."""
    assert run["state"] == "success", airflow.log_tail()
    xcom = airflow.call(
        "GET", f"/api/v2/dags/{SERVE}/dagRuns/{run['dag_run_id']}/taskInstances/"
        "smoke_test_latest/xcomEntries/return_value",
    )  # fmt: skip
    value = xcom["value"] if isinstance(xcom["value"], dict) else json.loads(xcom["value"])
    assert value["source"] == "asset event", value
    return str(value["version"])


def _message(driver: Any, containing: str) -> str | None:
    from selenium.webdriver.common.by import By

    text = str(driver.find_element(By.ID, "message").text)
    return text if containing in text else None


def test_the_registry_page_lists_versions_refuses_a_viewer_and_rolls_back(
    s3_server, mnist_subset, tmp_path, browser
):
    from selenium.webdriver.common.by import By

    bucket = _registry(s3_server, mnist_subset)
    bucket_uri, s3 = f"s3://{bucket}", s3_server.client()
    manifests = {m["version"]: m for m in list_versions(bucket_uri, "mnist_cnn", client=s3)}
    # The deployment floor between the two: rolling back to V1 crosses it (an admin override).
    low, high = (manifests[v]["metrics"]["val_accuracy"] for v in (V1, V2))
    assert low < high, (low, high)  # the centroids of all images beat those of a tenth
    floor = (low + high) / 2
    dags = tmp_path / "dags"
    dags.mkdir()
    shutil.copy(REPO / "dags" / "serve_latest_model.py", dags)
    env = {"HVA_BUCKET": bucket, "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
           "AIRFLOW__SCHEDULER__SCHEDULER_HEARTBEAT_SEC": "2",
           "HVA_MIN_ACCURACY_FLOOR": repr(floor)}  # fmt: skip
    airflow = Standalone(tmp_path / "home", dags, s3_server, tmp_path / "sa.log", env)
    try:
        airflow.wait("the serving DAG parsed", lambda: airflow.call("GET", f"/api/v2/dags/{SERVE}"),
                     300)  # fmt: skip
        plugins = airflow.call("GET", "/api/v2/plugins")["plugins"]
        (ours,) = [p for p in plugins if p["name"] == "horovod_airflow_registry"]
        assert ours["external_views"][0]["href"] == PAGE, ours

        # A viewer: every version with its figures, the refused run, no buttons; refused.
        _sign_in(browser, airflow, "viewer")
        rows = browser.find_elements(By.CSS_SELECTOR, "tr.version")
        assert [r.get_attribute("data-version") for r in rows] == [V2, V1]
        for row in rows:
            manifest = manifests[row.get_attribute("data-version")]
            accuracy = row.find_element(By.CSS_SELECTOR, "td.accuracy").text
            assert accuracy == f"{100 * manifest['metrics']['val_accuracy']:.2f} %"
            assert manifest["dataset"]["uri"] in row.text and "manual__v" in row.text
            assert row.find_element(By.CSS_SELECTOR, "td.gate").text.startswith("passed")
        assert "latest: " + V2 in browser.find_element(By.CSS_SELECTOR, "p.latest").text
        assert (
            "below the floor 98.0000%"
            in browser.find_element(By.CSS_SELECTOR, "table.refused").text
        )
        (candidate,) = browser.find_elements(By.CSS_SELECTOR, "tr.candidate")
        assert candidate.get_attribute("data-version") == V3
        v3 = read_candidate(bucket_uri, "mnist_cnn", V3, client=s3)
        assert candidate.find_element(By.CSS_SELECTOR, "td.accuracy").text == (
            f"{100 * v3['metrics']['val_accuracy']:.2f} %"
        )
        assert candidate.find_element(By.CSS_SELECTOR, "td.gate").text == (
            "refused: accuracy below the floor 99.0000%"
        )
        assert browser.find_elements(By.CSS_SELECTOR, "button.move") == []
        before = read_latest(bucket_uri, "mnist_cnn", client=s3)
        status, body = _promote_as(browser, V1)
        assert status == 403 and "viewer may not move" in body["detail"], body
        status, body = _promote_as(browser, V3, override="a viewer's override")
        assert status == 403 and "viewer may not move" in body["detail"], body
        assert read_latest(bucket_uri, "mnist_cnn", client=s3) == before
        assert read_version(bucket_uri, "mnist_cnn", V3, client=s3) is None
        assert read_history(bucket_uri, "mnist_cnn", client=s3) == []

        # An admin rolls back from the page: V1 is below the floor, refused without an
        # override reason; with one, latest.json moves and serving serves V1 on the event.
        _sign_in(browser, airflow, "admin")
        browser.find_element(By.CSS_SELECTOR, "input.reason").send_keys("V2 fails on sevens")
        button = browser.find_element(By.CSS_SELECTOR, f"button.move[data-version='{V1}']")
        button.click()
        message = airflow.wait("the page's refusal", lambda: _message(browser, "refused"), 60)
        assert "refused (409)" in message and "below the deployment floor" in message, message
        assert "needs an override reason" in message, message
        assert read_latest(bucket_uri, "mnist_cnn", client=s3) == before
        browser.find_element(By.CSS_SELECTOR, "input.override").send_keys("incident 7")
        button.click()
        message = airflow.wait("the page's answer", lambda: _message(browser, "now names"), 60)
        assert message == f"latest.json now names {V1} (reload to see it)", message
        latest, _ = read_latest(bucket_uri, "mnist_cnn", client=s3)
        assert latest["version"] == V1 and latest["promotion"]["actor"] == "admin"
        assert latest["promotion"]["action"] == "rollback"
        assert latest["promotion"]["reason"] == "V2 fails on sevens"
        assert latest["promotion"]["override"] is True
        assert latest["promotion"]["override_reason"] == "incident 7"
        (record,) = read_history(bucket_uri, "mnist_cnn", client=s3)
        assert record["previous_version"] == V2

        (run,) = airflow.wait("the serving run on the event", lambda: _served(airflow, 1), 300)
        assert _served_version(airflow, run) == V1
        browser.get(airflow.base + PAGE)
        assert "rollback by admin: V2 fails on sevens" in browser.find_element(
            By.CSS_SELECTOR, "p.latest").text  # fmt: skip
        assert "(admin override: incident 7)" in browser.find_element(
            By.CSS_SELECTOR, "p.latest").text  # fmt: skip

        # The refused candidate V3: an admin sees its button; refused (409) without an
        # override reason, nothing published; with one, published, promoted and served.
        browser.find_element(By.CSS_SELECTOR, "input.reason").send_keys("the floor was wrong")
        button = browser.find_element(By.CSS_SELECTOR, f"button.move[data-version='{V3}']")
        assert button.text == "Promote (admin override)"
        before = read_latest(bucket_uri, "mnist_cnn", client=s3)
        button.click()
        message = airflow.wait("the page's refusal", lambda: _message(browser, "refused"), 60)
        assert "refused (409)" in message and "its gate did not pass" in message, message
        assert "needs an override reason" in message, message
        assert read_latest(bucket_uri, "mnist_cnn", client=s3) == before
        assert read_version(bucket_uri, "mnist_cnn", V3, client=s3) is None
        browser.find_element(By.CSS_SELECTOR, "input.override").send_keys("incident 8")
        button.click()
        message = airflow.wait("the page's answer", lambda: _message(browser, "now names"), 60)
        assert message == f"latest.json now names {V3} (reload to see it)", message
        latest, _ = read_latest(bucket_uri, "mnist_cnn", client=s3)
        assert latest["version"] == V3 and latest["uri"] == f"{bucket_uri}/models/mnist_cnn/{V3}"
        assert latest["promotion"]["override_reason"] == "incident 8"
        assert latest["promotion"]["reason"] == "the floor was wrong"
        assert "its gate did not pass" in latest["promotion"]["checks"][0]
        published = read_version(bucket_uri, "mnist_cnn", V3, client=s3)
        assert published is not None and published["gate"] == v3["gate"]
        runs = airflow.wait("the serving run on V3's event", lambda: _served(airflow, 2), 300)
        assert _served_version(airflow, runs[0]) == V3
        browser.get(airflow.base + PAGE)
        assert browser.find_elements(By.CSS_SELECTOR, "tr.candidate") == []
        assert "★ latest" in browser.find_element(
            By.CSS_SELECTOR, f"tr.version[data-version='{V3}']").text  # fmt: skip
        assert browser.find_element(
            By.CSS_SELECTOR, f"tr.version[data-version='{V3}'] td.gate"
        ).text.startswith("refused")
        browser.get(airflow.base + PAGE)
        shot = tmp_path / "registry_page.png"
        browser.save_screenshot(str(shot))
        if os.environ.get("HVA_UPDATE_DOCS_SCREENSHOTS") == "1":
            shutil.copy(shot, REPO / "docs" / "registry_page.png")
    finally:
        airflow.stop()
    assert Path(shot).stat().st_size > 10_000
