"""The service's HTML pages in a real headless browser (Debian's chromium driven by Selenium
through chromium-driver) against a real ``autotune serve`` on a database holding a real small
``autotune tune`` run, plus one imported entry on another device kind.

Without chromium and chromium-driver these tests skip, or fail when ``CI`` is set (``.ci/run``
installs both). Screenshots go to ``artifacts/`` in the repository root.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from conftest import Server, run_cli
from kernel import FlashConfig
from kernel.problem import Problem
from storage import Store, TunedResult

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
TUNED = Problem(1, 1, 1, 256, 256, 128, "float32", False, "fwd")
IMPORTED = Problem(2, 8, 8, 1024, 1024, 128, "bfloat16", True, "fwd")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,900")


@pytest.fixture(scope="module")
def pages_server(start_server: Callable[..., Server],
           tmp_path_factory: pytest.TempPathFactory) -> Server:
    """A server on a database with a real tuning run (cpu, float32) and one entry published
    without a study (TPU v5 lite, bfloat16)."""
    url = f"sqlite:///{tmp_path_factory.mktemp('pages') / 'autotune.db'}"
    tuned = run_cli("tune", "--kernel", "flash", "--q-len", "256", "--q-heads", "1", "--head-dim", "128",
                    "--dtype", "float32", "--trials", "5", "--db", url, timeout=300)
    assert tuned.returncode == 0, tuned.stderr
    with Store(url) as store:
        store.publish(TunedResult(device_kind="TPU v5 lite", problem=IMPORTED,
                                  config=FlashConfig(block_q=512, block_kv=512,
                                                     block_kv_compute=512),
                                  median_ms=0.8, default_median_ms=1.0))
    return start_server(url)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """Headless chromium through Selenium, with a fresh profile and its console log kept."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("the selenium package (pip install -e '.[test]')")
    if missing:
        message = (f"missing {', '.join(missing)}; install with `apt-get install -y chromium "
                   "chromium-driver` (.ci/run does)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _severe(browser: object) -> list[dict]:
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def _rows(browser: object) -> list[tuple[str, str]]:
    from selenium.webdriver.common.by import By

    return [(row.get_attribute("data-device-kind"), row.get_attribute("data-dtype"))
            for row in browser.find_elements(By.CSS_SELECTOR, "tr.entry")]


def _screenshot(browser: object, name: str) -> Path:
    """A full-page screenshot under artifacts/."""
    ARTIFACTS.mkdir(exist_ok=True)
    height = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1280, max(900, height + 200))
    path = ARTIFACTS / name
    browser.save_screenshot(str(path))
    browser.set_window_size(1280, 900)
    return path


def _filter(browser: object, **values: str) -> None:
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    for name, value in values.items():
        Select(browser.find_element(By.ID, f"filter-{name}")).select_by_value(value)
    old = browser.find_element(By.TAG_NAME, "html")
    browser.find_element(By.ID, "filter-submit").click()

    def replaced(_: object) -> bool:
        """The submitted form's page has replaced the old one. Mid-navigation chromedriver
        may answer for the old node "does not belong to the document" instead of the stale
        element error that selenium's ``staleness_of`` expects: that is the same fact."""
        try:
            old.is_enabled()
        except StaleElementReferenceException:
            return True
        except WebDriverException as exc:
            if "does not belong to the document" not in str(exc):
                raise
            return True
        return False

    WebDriverWait(browser, 30).until(replaced)


def test_list_page_filters_by_device_and_dtype(pages_server: Server, browser: object) -> None:
    from selenium.webdriver.common.by import By

    browser.get(pages_server.url + "/")
    assert browser.title == "flash-autotune: tuned configs"
    assert sorted(_rows(browser)) == [("TPU v5 lite", "bfloat16"), ("cpu", "float32")]
    _screenshot(browser, "pages-list.png")

    _filter(browser, device_kind="cpu")
    assert "device_kind=cpu" in browser.current_url
    assert _rows(browser) == [("cpu", "float32")]
    assert "1 tuned config matches" in browser.find_element(By.ID, "count").text

    _filter(browser, device_kind="", dtype="bfloat16")
    assert _rows(browser) == [("TPU v5 lite", "bfloat16")]

    _filter(browser, device_kind="cpu", dtype="bfloat16")
    assert _rows(browser) == []
    assert "No tuned configs match these filters" in browser.page_source
    assert _severe(browser) == []


def test_detail_page_shows_the_plots(pages_server: Server, browser: object) -> None:
    from selenium.webdriver.common.by import By

    browser.get(pages_server.url + "/?device_kind=cpu")
    browser.find_element(By.CSS_SELECTOR, "tr.entry a.detail").click()
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith(TUNED.label())
    images = browser.find_elements(By.CSS_SELECTOR, "img[data-plot]")
    assert [img.get_attribute("data-plot") for img in images] == [
        "landscape", "convergence", "confirmation", "failures"]
    for img in images:
        loaded = browser.execute_script(
            "return arguments[0].complete && arguments[0].naturalWidth", img)
        assert loaded > 0, img.get_attribute("data-plot")
    path = _screenshot(browser, "pages-detail.png")
    assert path.stat().st_size > 10_000
    assert _severe(browser) == []


def test_detail_of_an_entry_without_a_study_says_so(pages_server: Server, browser: object) -> None:
    from selenium.webdriver.common.by import By

    browser.get(pages_server.url + "/?dtype=bfloat16")
    browser.find_element(By.CSS_SELECTOR, "tr.entry a.detail").click()
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith(IMPORTED.label())
    assert browser.find_elements(By.CSS_SELECTOR, "img[data-plot]") == []
    assert "no tuning study for this result" in browser.page_source
    assert _severe(browser) == []


@pytest.mark.parametrize(("path", "status", "message"), [
    ("/?dtype=float8", 422, "dtype: Input should be"),
    ("/?device_kind=%01", 422, "device_kind: String should match pattern"),
    ("/configs/detail", 422, "kernel: Field required"),
    ("/configs/detail?kernel=flash&kernel_version=1&device_kind=cpu&platform=cpu&batch=x"
     "&q_heads=1&q_len=256&head_dim=128", 422, "batch: give an integer, got 'x'"),
    ("/configs/detail?kernel=flash&kernel_version=1&device_kind=cpu&platform=cpu&batch=1"
     "&q_heads=3&kv_heads=2&q_len=256&head_dim=128", 422, "must be a multiple of kv_heads"),
    ("/configs/detail?kernel=flash&kernel_version=1&device_kind=cpu&platform=cpu&batch=7"
     "&q_heads=1&q_len=256&head_dim=128", 404, "Nothing is stored for flash 1 on"),
])
def test_bad_parameters_get_a_clear_page(pages_server: Server, path: str, status: int,
                                         message: str) -> None:
    response = httpx.get(pages_server.url + path, timeout=30)
    assert response.status_code == status
    assert response.headers["content-type"].startswith("text/html")
    assert message in response.text.replace("&#39;", "'")
