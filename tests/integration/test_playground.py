"""The playground page in a real headless browser (Debian's chromium and chromium-driver,
driven by selenium) against a real server of the `demo` model with an API key: the page
lists the adapters, generates with the one picked, shows the image with its timings, and
keeps the last images side by side. `.ci/run` installs the browser when it is missing."""

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support import shapes
from support.servers import ServerProcess

pytestmark = [pytest.mark.browser,
              pytest.mark.skipif(not (shutil.which("chromium") and shutil.which("chromedriver")),
                                 reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")]
KEY = "playground-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(["--model", "demo", "--adapters", str(tmp_path_factory.mktemp("demo-adapters")),
                             "--demo-adapters", "--api-key", KEY], tmp_path_factory.mktemp("logs") / "server.log")
    process.wait_ready()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1200,900"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    yield driver
    driver.quit()


def wait(browser, condition, timeout=60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout).until(lambda driver: condition())


def test_the_page_is_served_and_ready_says_what_the_model_takes(server):
    import httpx

    page = httpx.get(server.url + "/playground")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script" in page.text and "http" not in page.text.split("<script", 1)[1], "nothing fetched from elsewhere"
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy and "'unsafe-inline'" not in policy
    assert "script-src 'sha256-" in policy and "connect-src 'self'" in policy
    assert (page.headers["x-frame-options"], page.headers["x-content-type-options"]) == ("DENY", "nosniff")
    assert httpx.get(server.url + "/ready").json()["capabilities"] == {"demo": {
        "image_input": "variants", "masks": True, "output": "image", "size_multiple": 8, "max_size": [128, 128],
        "defaults": {"width": 32, "height": 32, "steps": 20, "guidance": 3.0}, "step_caches": [], "step_cache": "off",
        "sampler": "EulerDiscreteScheduler"}}


def test_pick_an_adapter_generate_and_see_the_image_with_its_timings(server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    find = browser.find_element
    browser.get(server.url + "/playground")
    # the key opens the API: the model's defaults fill the form, the adapters are listed
    find(By.ID, "key").send_keys(KEY)
    browser.execute_script("document.getElementById('key').dispatchEvent(new Event('change'))")
    wait(browser, lambda: "ready" in find(By.ID, "status").text)
    assert find(By.ID, "width").get_attribute("value") == "32" and find(By.ID, "steps").get_attribute("value") == "20"
    rows = wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, "#adapters tr.adapter"))
    assert {row.get_attribute("data-id") for row in rows} == {"outline", "striped", "pastel", "night", "big"}
    assert find(By.ID, "image-input").get_attribute("class") == "", "the demo model takes an input image"
    # one image without an adapter, then one with `outline`
    find(By.ID, "generate").click()
    wait(browser, lambda: len(browser.find_elements(By.CSS_SELECTOR, "#history figure")) == 1)
    find(By.CSS_SELECTOR, '#adapters tr[data-id="outline"] .use').click()
    find(By.ID, "generate").click()
    wait(browser, lambda: len(browser.find_elements(By.CSS_SELECTOR, "#history figure")) == 2)
    assert find(By.ID, "error").text == ""
    timings = find(By.ID, "timings").text
    assert re.search(r"x-compute-time \d+\.\d+ s · x-swap-ms \d+\.\d+ ms", timings), timings
    assert float(re.search(r"x-swap-ms (\S+)", timings).group(1)) > 0, "the adapter was swapped in"
    assert browser.execute_script("return document.getElementById('image-out').naturalWidth") == 32
    captions = [f.text for f in browser.find_elements(By.CSS_SELECTOR, "#history figcaption")]
    assert captions[0].startswith("outline:1") and captions[1].startswith("no adapter"), captions
    # the adapter's kind is shown once the server has read it
    wait(browser, lambda: "lora" in find(By.CSS_SELECTOR, '#adapters tr[data-id="outline"] .kinds').text)
    # what the page shows is the image the server made: the outline left the shape hollow
    shots = [_image_of(browser, img, tmp_path / f"{i}.png")
             for i, img in enumerate(browser.find_elements(By.CSS_SELECTOR, "#history img"))]
    assert shots[0].shape == shots[1].shape == (32, 32, 3) and not np.array_equal(shots[0], shots[1])
    assert shapes.read(shots[0]).hollow > 0.5 and shapes.read(shots[1]).hollow < 0.2


def test_without_the_key_the_page_says_what_is_wrong(server, browser):
    from selenium.webdriver.common.by import By

    browser.get(server.url + "/playground")
    browser.execute_script("sessionStorage.clear()")
    browser.get(server.url + "/playground")
    find = browser.find_element
    wait(browser, lambda: "ready" in find(By.ID, "status").text)  # /ready is open
    note = wait(browser, lambda: (text := find(By.ID, "adapter-note").text) and text)
    assert "401" in note and "key" in note, note
    find(By.ID, "generate").click()
    error = wait(browser, lambda: (text := find(By.ID, "error").text) and text)
    assert error.startswith("401:"), error


def _image_of(browser, img, path: Path) -> np.ndarray:
    """The pixels an <img> holds (its blob), read back through a canvas in the page."""
    data = browser.execute_script(
        "const img = arguments[0], c = document.createElement('canvas');"
        "c.width = img.naturalWidth; c.height = img.naturalHeight;"
        "c.getContext('2d').drawImage(img, 0, 0); return c.toDataURL('image/png');", img)
    import base64

    path.write_bytes(base64.b64decode(data.split(",", 1)[1]))
    return np.asarray(Image.open(path).convert("RGB"))
