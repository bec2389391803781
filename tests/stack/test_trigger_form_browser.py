"""The manual trigger as a user does it: a real browser (Debian's headless chromium and its
driver, through selenium; nothing is downloaded) on the compose stack's Airflow UI.

Log in (FAB), open ``mnist_horovod_retrain``, open Trigger: the form shows every Param by its
title with its description (as the DAG declares them, read back through the REST API); values
the Params forbid are refused before any run starts; a valid form starts a run that succeeds.
Screenshots of the form and of the finished run's graph are saved in the stack's state folder,
and into docs/ with ``HVA_UPDATE_DOCS_SCREENSHOTS=1`` (how the README's pictures are made).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.browser import headless_chromium
from tests.conftest import REPO
from tests.engine_scripts import BUILD_TIMEOUT
from tests.stack.conftest import PUBLISHED_RUN, Stack, compose_stack, load_stack_smoke

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(BUILD_TIMEOUT + 2400)]

DAG_ID = "mnist_horovod_retrain"
DOCS = REPO / "docs"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium(window="1400,1000", implicit_wait=15) as driver:
        yield driver


class TriggerForm:
    """The Trigger Dag dialog of the Airflow 3 UI, found by what a user sees: labels, buttons."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    def field(self, title: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(
            By.XPATH,
            "//div[@data-scope='field' and @data-part='root']"
            f"[.//label[normalize-space(text()[1])='{title}']]",
        )

    def input(self, title: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.field(title).find_element(By.CSS_SELECTOR, "input:not([type=hidden])")

    def description(self, title: str) -> str:
        from selenium.webdriver.common.by import By

        return str(self.field(title).find_element(By.CSS_SELECTOR, "[data-part=helper-text]").text)

    def type(self, title: str, value: str) -> str:
        """Replace the field's text as a user would, leave it, and return what it then holds.

        The field is emptied first and checked empty: on a loaded machine the UI can still be
        rendering when the keys arrive, and text typed after an old value is another value.
        """
        from selenium.webdriver.common.keys import Keys

        box = self.input(title)
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", box)
        box.click()
        for _ in range(20):
            box.send_keys(Keys.CONTROL, "a")
            box.send_keys(Keys.BACKSPACE)
            if box.get_attribute("value") == "":
                break
            time.sleep(0.25)
        assert box.get_attribute("value") == "", f"{title}: the field could not be emptied"
        for char in value:
            box.send_keys(char)
        box.send_keys(Keys.TAB)
        time.sleep(0.5)
        return str(self.input(title).get_attribute("value"))

    def submit(self) -> None:
        from selenium.webdriver.common.by import By

        button = self.driver.find_element(By.CSS_SELECTOR, "[data-testid=trigger-dag-submit]")
        self.driver.execute_script("arguments[0].scrollIntoView()", button)
        button.click()


def login(driver: Any, stack: Stack) -> None:
    from selenium.common.exceptions import NoSuchElementException
    from selenium.webdriver.common.by import By

    driver.get(stack.airflow_url + "/auth/login/")
    try:
        user = driver.find_element(By.ID, "username")
    except NoSuchElementException as e:  # say what the browser got instead of a login form
        text = driver.find_element(By.TAG_NAME, "body").text[:600]
        raise AssertionError(
            f"no login form at {driver.current_url} (title {driver.title!r}): {text!r}"
        ) from e
    user.send_keys(stack.settings["AIRFLOW_ADMIN_USER"])
    driver.find_element(By.ID, "password").send_keys(stack.settings["AIRFLOW_ADMIN_PASSWORD"])
    driver.find_element(By.CSS_SELECTOR, "input[type=submit],button[type=submit]").click()
    deadline = time.monotonic() + 30
    while "/auth/login" in driver.current_url and time.monotonic() < deadline:
        time.sleep(0.5)
    assert "/auth/login" not in driver.current_url, "the login did not leave the login page"


def open_trigger_form(driver: Any, stack: Stack) -> TriggerForm:
    from selenium.webdriver.common.by import By

    driver.get(f"{stack.airflow_url}/dags/{DAG_ID}")
    driver.find_element(By.CSS_SELECTOR, "button[aria-label='Trigger Dag']").click()
    driver.find_element(By.XPATH, f"//*[normalize-space(.)='Trigger Dag - {DAG_ID}']")
    return TriggerForm(driver)


def save_screenshot(driver: Any, stack: Stack, name: str) -> Path:
    path = stack.state / name
    driver.save_screenshot(str(path))
    if os.environ.get("HVA_UPDATE_DOCS_SCREENSHOTS") == "1":
        shutil.copy(path, DOCS / name)
    return path


def shown(driver: Any, text: str, timeout: float = 15) -> bool:
    """Whether an element with exactly ``text`` becomes visible (toasts animate in; the same
    text can also sit in hidden live regions for screen readers)."""
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = driver.find_elements(By.XPATH, f"//*[normalize-space(.)='{text}']")
        if any(e.is_displayed() for e in found):
            return True
        time.sleep(0.25)
    return False


def run_ids(api: Any) -> set[str]:
    """The DAG's triggered runs. Its schedule may add one meanwhile (the stack's DAG is
    unpaused: @weekly fired during a run on a Sunday), which no trigger made."""
    runs = api.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns")["dag_runs"]
    return {r["dag_run_id"] for r in runs if r["run_type"] == "manual"}


def test_the_trigger_form_in_a_browser(stack: Stack, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    smoke = load_stack_smoke()
    api = smoke.AirflowApi.login(
        stack.airflow_url, stack.settings["AIRFLOW_ADMIN_USER"],
        stack.settings["AIRFLOW_ADMIN_PASSWORD"],
    )  # fmt: skip
    api.wait_for_dag(DAG_ID)
    params = api.call("GET", f"/api/v2/dags/{DAG_ID}/details")["params"]
    assert len(params) == 9, params

    login(browser, stack)
    browser.set_window_size(1400, 2400)  # the whole form in one screenshot
    form = open_trigger_form(browser, stack)

    # Every Param by its title, with its description.
    for name, param in params.items():
        title = param["schema"]["title"]
        assert form.description(title) == param["description"], name
    save_screenshot(browser, stack, "trigger_form.png")

    before = run_ids(api)
    # num_proc 0: the form cannot hold it (the field goes back to the minimum, 1).
    assert form.type("Ranks", "0") == "1"
    assert form.type("Ranks", "2") == "2"
    # A dataset_source that fails its pattern: the trigger is refused, no run starts.
    form.type("Dataset", "relative/folder")
    form.submit()
    assert shown(browser, "Failed to Trigger Dag"), "no 'Failed to Trigger Dag' message shown"
    time.sleep(2)
    assert run_ids(api) == before, "a refused trigger started a run"

    # A valid form: a small CPU run that the gate lets through whatever was published before.
    assert form.type("Dataset", "vendored") == "vendored"
    assert form.type("Training samples", "6000") == "6000"
    assert form.type("Minimum accuracy", "0.9") == "0.9"
    assert form.type("Allowed regression", "1") == "1"
    form.submit()
    deadline = time.monotonic() + 60
    while not (new := run_ids(api) - before) and time.monotonic() < deadline:
        time.sleep(1)
    assert len(new) == 1, f"the valid trigger started {sorted(new)}"
    run_id = new.pop()
    conf = api.call("GET", f"/api/v2/dags/{DAG_ID}/dagRuns/{urllib.parse.quote(run_id)}")["conf"]
    assert conf["num_proc"] == 2 and conf["max_train_samples"] == 6000, conf
    assert conf["dataset_source"] == "vendored" and conf["max_regression"] == 1, conf
    run = api.wait_for_run(DAG_ID, run_id, timeout=1800)
    states = api.task_states(DAG_ID, run_id)
    assert run["state"] == "success", {
        t: api.task_log(DAG_ID, run_id, t)[-2000:] for t, s in states.items() if s != "success"
    }
    assert states == PUBLISHED_RUN, states

    # The finished run's graph, as the user sees it.
    browser.set_window_size(1400, 1000)
    browser.get(f"{stack.airflow_url}/dags/{DAG_ID}/runs/{urllib.parse.quote(run_id)}")
    browser.find_element(By.CSS_SELECTOR, "button[aria-label^='Show Graph']").click()
    for task_id in states:
        browser.find_element(By.XPATH, f"//*[normalize-space(text())='{task_id}']")
    time.sleep(3)  # the graph's layout settles
    save_screenshot(browser, stack, "run_graph.png")


def test_the_registry_page_lists_the_versions_the_stacks_runs_published(
    stack: Stack, browser: Any
) -> None:
    """The stack's Airflow UI serves the registry page (the plugin from the image's plugins
    folder): every version the stack's runs published — those of the tests before, or, run
    alone, one smoke run's — with its accuracy and its run, which one ``latest.json`` names,
    and its curves."""
    from selenium.webdriver.common.by import By

    from horovod_airflow.operators.model_registry import read_latest
    from horovod_airflow.operators.model_registry.promote import list_versions

    smoke = load_stack_smoke()
    s3 = smoke.s3_client(stack.settings)
    bucket_uri = f"s3://{stack.settings['HVA_BUCKET']}"
    versions = list_versions(bucket_uri, smoke.MODEL_NAME, client=s3)
    if not versions:  # run alone: the stack has published nothing yet
        summary = json.loads(compose_stack("smoke", stack.script_env, 2400))
        assert summary["failures"] == [], summary
        versions = list_versions(bucket_uri, smoke.MODEL_NAME, client=s3)
    latest, _ = read_latest(bucket_uri, smoke.MODEL_NAME, client=s3)
    assert latest is not None and versions, versions

    browser.delete_all_cookies()
    login(browser, stack)
    browser.get(f"{stack.airflow_url}/horovod-registry/")
    section = browser.find_element(By.CSS_SELECTOR, f"section[data-model='{smoke.MODEL_NAME}']")
    rows = section.find_elements(By.CSS_SELECTOR, "tr.version")
    assert [r.get_attribute("data-version") for r in rows] == [v["version"] for v in versions]
    for row, version in zip(rows, versions, strict=True):
        accuracy = row.find_element(By.CSS_SELECTOR, "td.accuracy").text
        assert accuracy == f"{100 * version['metrics']['val_accuracy']:.2f} %", row.text
        assert version["dag_run_id"] in row.text
        assert row.find_element(By.CSS_SELECTOR, "td.gate").text.startswith("passed")
    assert "latest: " + latest["version"] in section.find_element(By.CSS_SELECTOR, "p.latest").text
    # The curves the page shows are the published PNGs, served through the page's own API.
    width = browser.execute_script(
        "const i = arguments[0]; return i.complete ? i.naturalWidth : 0;",
        rows[0].find_element(By.CSS_SELECTOR, "img"),
    )
    assert width and int(width) > 100, width
    save_screenshot(browser, stack, "stack_registry_page.png")
