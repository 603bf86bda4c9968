"""The page in a real browser (headless Chromium from the Debian packages, driven by Selenium with
chromium-driver): open it, pick the tiny demo, press "safe defaults", start the run, watch the grad-norm plot
update while it trains, and save a screenshot (tmp_path/webui.png; also to $FUSED_STABLE_WEBUI_SCREENSHOT
when set, which is how docs/webui.png is made). Skips, saying why, only where no Chromium is found."""

import os
import re
import shutil
import tempfile
import time

import pytest
from conftest import Served
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
# headless as root on a closed network: no sandbox, no GPU, and none of Chromium's own background connections
FLAGS = (
    "--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking "
    "--disable-component-update --disable-sync --window-size=1280,1700"
).split()

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="no Chromium / chromedriver found (apt-get install -y chromium chromium-driver)",
)


def _wait(driver, condition, what, timeout=240):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except Exception:  # an element that is not there yet, or being re-rendered
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            driver.save_screenshot(os.path.join(tempfile.gettempdir(), "webui-timeout.png"))
            pytest.fail(f"timed out waiting for {what}; page status: {_text(driver, 'live_status')!r}")
        time.sleep(0.25)


def _text(driver, elem_id):
    try:
        return driver.find_element(By.ID, elem_id).text
    except Exception:
        return ""


def _plot_step(driver) -> int | None:
    found = re.search(r"pre-clip grad norm, step (\d+)", _text(driver, "live_grad_norm_plot"))
    return int(found.group(1)) if found else None


def test_safe_defaults_start_and_the_grad_norm_plot_updates(tmp_path, gradio_env):
    server = Served(tmp_path / "workspace", tick_s=1.0)
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path / 'chromium'}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        driver.get(server.url)
        _wait(driver, lambda: driver.find_element(By.ID, "safe_defaults"), "the page")
        tiny = _wait(driver, lambda: driver.find_element(By.XPATH, "//label[contains(., 'tiny demo')]"), "presets")
        tiny.click()
        command = lambda: _text(driver, "command")  # noqa: E731
        _wait(driver, lambda: "--model=tiny" in command() and "--max_steps=50" in command(), "the tiny demo's keys")
        driver.find_element(By.ID, "safe_defaults").click()
        _wait(driver, lambda: "guards against" in _text(driver, "safe_info"), "the safe defaults' table")
        assert "max_grad_norm" in _text(driver, "safe_info") and "warmup_ratio" in _text(driver, "safe_info")
        _wait(driver, lambda: "--lora_r=16" in command() and "--lora_alpha=32" in command(), "rank 16 in the command")
        assert _plot_step(driver) is None  # no run yet: the plot shows no steps

        driver.find_element(By.ID, "start").click()
        _wait(driver, lambda: "started" in _text(driver, "message"), "the start")
        first = _wait(driver, lambda: _plot_step(driver), "the first grad-norm points")
        later = _wait(driver, lambda: (_plot_step(driver) or 0) > first and _plot_step(driver), "the plot to update")
        assert later > first
        plot = driver.find_element(By.ID, "live_grad_norm_plot")
        assert "clip threshold 1" in plot.text  # the clip line is drawn beside the norm
        assert plot.find_elements(By.CSS_SELECTOR, "svg .mark-line path, canvas")
        _wait(driver, lambda: ": finished" in _text(driver, "live_status"), "the end of the run")
        assert "step 50 / 50" in _text(driver, "live_status")
        driver.set_window_size(1280, driver.execute_script("return document.body.scrollHeight") + 40)
        time.sleep(1.5)  # one more refresh, so the plots are drawn at the final size
        shot = tmp_path / "webui.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        if os.environ.get("FUSED_STABLE_WEBUI_SCREENSHOT"):
            shutil.copyfile(shot, os.environ["FUSED_STABLE_WEBUI_SCREENSHOT"])
    finally:
        driver.quit()
        server.close()
