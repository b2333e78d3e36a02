"""The pages of `ckvc serve` in a real headless Chromium (Debian's chromium and
chromium-driver, driven by selenium; .ci/setup installs them): each renders with no
console error, and what it draws matches the CLI's --json. One browser and one
server for the module. Screenshots go to $CKVC_WEB_SCREENSHOTS (docs/img when the
README's images are refreshed) or pytest's temporary directory.

Without the browser the module is skipped, except under CI=true, where that fails."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run
from webrepo import Built, build_repo, serving

import ckvc
from ckvc.web import WebServer

CHROMIUM = os.environ.get("CKVC_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("CKVC_CHROMEDRIVER", "/usr/bin/chromedriver")


def _missing() -> str | None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if shutil.which(path) is None:
            return f"{path} not installed (apt-get install chromium chromium-driver)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium not installed (pip install -e '.[web-test]')"
    return None


MISSING = _missing()
if MISSING is not None:
    if os.environ.get("CI") == "true":  # CI must run these, never skip them silently
        raise RuntimeError(f"browser tests cannot run under CI: {MISSING}")
    pytest.skip(MISSING, allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    return build_repo(tmp_path_factory.mktemp("web") / "repo")


@pytest.fixture(scope="module")
def server(built: Built) -> Iterator[WebServer]:
    yield from serving(built.path)


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("CKVC_WEB_SCREENSHOTS")
    path = Path(given) if given else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1300,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def cli_json(path: Path, *args: str) -> Any:
    result = run(path, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def wait_for(browser: Any, condition: Callable[[Any], Any], timeout: float = 20) -> Any:
    return WebDriverWait(browser, timeout, poll_frequency=0.05).until(condition)


def open_page(browser: Any, server: WebServer, page: str, expect: str) -> list[dict[str, Any]]:
    """Load ``page``, wait until it has drawn, and return the console's messages."""
    browser.get(server.url + page)
    wait_for(browser, lambda b: b.execute_script("return document.body.dataset.rendered || null"))
    rendered = browser.execute_script("return document.body.dataset.rendered")
    error = browser.find_elements(By.ID, "page-error")
    assert rendered == expect, error[0].text if error else rendered
    return [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def attrs(browser: Any, selector: str, name: str) -> list[str]:
    return browser.execute_script(
        "return [...document.querySelectorAll(arguments[0])].map((e) => e.getAttribute(arguments[1]))", selector, name
    )


PAGES = [
    ("history", "history"),
    ("metrics", "metrics"),
    ("commit/v2", "commit"),
    ("diff?a=main~1&b=main", "diff"),
    ("storage", "storage"),
]


@pytest.mark.parametrize(("page", "kind"), PAGES, ids=[k for _, k in PAGES])
def test_page_renders_without_console_errors(
    browser: Any, server: WebServer, shots: Path, page: str, kind: str
) -> None:
    browser.get_log("browser")  # drop what earlier pages left
    console = open_page(browser, server, page, kind)
    assert console == []
    height = min(browser.execute_script("return document.documentElement.scrollHeight"), 1800)
    metrics = {"width": 1300, "height": height, "deviceScaleFactor": 1, "mobile": False}
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)  # the whole page, up to 1800 px
    try:
        shot = browser.execute_cdp_cmd("Page.captureScreenshot", {"format": "png"})
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    (shots / f"web-{kind}.png").write_bytes(base64.b64decode(shot["data"]))


def test_history_shows_every_commit_label_and_mark(browser: Any, server: WebServer, built: Built) -> None:
    open_page(browser, server, "history", "history")
    ids = [c["id"] for c in cli_json(built.path, "log", "--all")]
    assert attrs(browser, "#dag circle.node", "data-id") == ids
    assert len(ids) == 7
    labels = sorted(attrs(browser, ".history-row .label", "data-label"))
    assert labels == ["HEAD -> main", "side", "tag: v1", "tag: v2"]
    assert attrs(browser, "#dag circle.node.pruned", "data-id") == [built.pruned]
    assert attrs(browser, "#dag circle.node.lossy", "data-id") == [built.lossy]
    assert browser.find_element(By.ID, "dag").get_attribute("data-lanes") == "2"  # one lane per branch


def test_metrics_chart_has_one_line_per_branch(browser: Any, server: WebServer, built: Built) -> None:
    open_page(browser, server, "metrics", "metrics")
    charts = attrs(browser, ".chart", "data-metric")
    assert charts == ["acc", "val_loss"]  # several side by side
    for metric in charts:
        lines = browser.find_elements(By.CSS_SELECTOR, f'.chart[data-metric="{metric}"] polyline.series')
        drawn = {line.get_attribute("data-branch"): len(line.get_attribute("points").split()) for line in lines}
        assert drawn == {"main": 5, "side": 5}, metric
        best = browser.find_element(By.CSS_SELECTOR, f'.chart[data-metric="{metric}"] circle.best')
        best_commit = {"acc": built.main[4], "val_loss": built.side[1]}[metric]  # highest acc, lowest loss
        assert best.get_attribute("data-commit") == best_commit
    rows = browser.find_elements(By.CSS_SELECTOR, "#metrics-table tbody tr")
    assert len(rows) == 7
    header = browser.find_element(By.CSS_SELECTOR, '#metrics-table th[data-key="val_loss"]')
    header.click()  # sort by val_loss, lowest first
    first = browser.find_element(By.CSS_SELECTOR, "#metrics-table tbody tr td a")
    assert first.text == built.side[1][:12]


def test_commit_page_lists_tensors_and_filters(browser: Any, server: WebServer, built: Built) -> None:
    open_page(browser, server, "commit/v2", "commit")
    show = cli_json(built.path, "show", "v2")
    assert attrs(browser, "#tensor-table tbody tr", "data-path") == [t["path"] for t in show["tensors"]]
    lossy_row = browser.find_element(By.CSS_SELECTOR, '#tensor-table tr[data-path="optimizer.state.0.exp_avg"]')
    assert "q8" in lossy_row.text and "quant" in lossy_row.text
    box = browser.find_element(By.ID, "tensor-filter")
    box.send_keys("layers.0")
    wait_for(browser, lambda b: len(b.find_elements(By.CSS_SELECTOR, "#tensor-table tbody tr")) == 2)
    assert sorted(attrs(browser, "#tensor-table tbody tr", "data-path")) == [
        "model.layers.0.bias",
        "model.layers.0.weight",
    ]
    assert attrs(browser, "#by-key g.bar", "data-name") == ["optimizer", "model"]


def test_diff_chart_lists_changed_tensors_in_order(browser: Any, server: WebServer, built: Built) -> None:
    open_page(browser, server, "diff?a=main~1&b=main", "diff")
    want = [c["path"] for c in cli_json(built.path, "diff", "main~1", "main")["changed"]]
    got = attrs(browser, "#diff-bars g.bar", "data-name")
    assert got == want
    model = [p for p in got if p.startswith("model.")]
    assert model == ["model.layers.2.weight", "model.layers.1.weight", "model.layers.0.weight"]
    assert sorted(attrs(browser, "#diff-heatmap rect.cell", "data-path")) == sorted(want)


def test_storage_totals_equal_du(browser: Any, server: WebServer, built: Built) -> None:
    open_page(browser, server, "storage", "storage")
    du = cli_json(built.path, "du")
    shown = {
        "logical_bytes": "du-logical",
        "unique_raw_bytes": "du-unique-raw",
        "stored_chunk_bytes": "du-stored",
        "pack_bytes": "du-packs",
        "commits": "du-commits",
        "pruned_commits": "du-pruned",
        "dedup_ratio": "du-dedup",
        "compression_ratio": "du-compression",
        "total_ratio": "du-total",
    }
    for key, element in shown.items():
        assert float(browser.find_element(By.ID, element).get_attribute("data-value")) == du[key], key
    per_commit = {c["commit"]: c["unique_stored_bytes"] for c in du["per_commit"]}
    bars = zip(attrs(browser, "rect.ubar", "data-commit"), attrs(browser, "rect.ubar", "data-bytes"), strict=True)
    drawn = dict(bars)
    assert {k: int(v) for k, v in drawn.items()} == per_commit
    assert attrs(browser, "#codec-bars g.bar", "data-name") == list(du["by_codec"])
    plan = cli_json(built.path, "retain", "--dry-run")
    assert browser.find_element(By.ID, "retention-policy").text == plan["policy"]
    assert int(browser.find_element(By.ID, "retention-kept").text) == len(plan["kept"])


def test_history_updates_when_a_commit_lands(browser: Any, server: WebServer, built: Built) -> None:
    """Last in the module: it adds a commit to the shared repository."""
    open_page(browser, server, "history", "history")
    before = len(attrs(browser, "#dag circle.node", "data-id"))
    with ckvc.Repo.open(built.path) as repo:
        new = repo.commit({"w": torch.ones(4)}, message="live", metrics={"val_loss": 0.01})
    wait_for(browser, lambda b: len(attrs(b, "#dag circle.node", "data-id")) == before + 1, timeout=30)
    assert attrs(browser, "#dag circle.node", "data-id")[0] == new
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []


# Everything a card holds fits inside it: no text or chart runs past its right edge.
OVERFLOWING = """
const out = [];
for (const card of document.querySelectorAll('.card')) {
  const box = card.getBoundingClientRect();
  if (card.scrollWidth > card.clientWidth + 1) out.push(`card ${card.className} scrolls: ${card.scrollWidth}`);
  for (const el of card.querySelectorAll('text, h2, .stat, td, th')) {
    const r = el.getBoundingClientRect();
    const past = r.right > box.right + 1 || r.left < box.left - 1;
    if (r.width && past) out.push(`${el.tagName} "${el.textContent.slice(0, 40)}" past its card`);
  }
}
return out;
"""


@pytest.mark.parametrize("width", [1280, 1440, 1920])
def test_nothing_is_clipped_at_common_widths(browser: Any, server: WebServer, shots: Path, width: int) -> None:
    browser.set_window_size(width, 1000)
    try:
        for page, kind in PAGES:
            open_page(browser, server, page, kind)
            overflowing = browser.execute_script(OVERFLOWING)
            shot = browser.execute_cdp_cmd("Page.captureScreenshot", {"format": "png"})
            (shots / f"web-{kind}-{width}.png").write_bytes(base64.b64decode(shot["data"]))
            assert overflowing == [], (page, width, overflowing[:5])
    finally:
        browser.set_window_size(1300, 900)


def test_metric_charts_have_axis_labels_whole_number_ticks_and_a_log_scale(
    browser: Any, server: WebServer, built: Built
) -> None:
    open_page(browser, server, "metrics", "metrics")
    labels = browser.execute_script("return [...document.querySelectorAll('.chart .xlabel')].map((e) => e.textContent)")
    assert labels and set(labels) <= {"step", "index"}
    assert browser.execute_script(
        "return [...document.querySelectorAll('.chart .ylabel')].map((e) => e.textContent)"
    ) == [
        "acc",
        "val_loss",
    ]
    ticks = browser.execute_script("return [...document.querySelectorAll('.chart .xtick')].map((e) => e.textContent)")
    assert ticks and all(t.lstrip("-").isdigit() for t in ticks), ticks  # step and index are whole numbers
    assert attrs(browser, ".chart svg", "data-scale") == ["linear", "linear"]
    browser.find_element(By.ID, "logy").click()
    wait_for(browser, lambda b: attrs(b, ".chart svg", "data-scale") == ["log", "log"])
    assert browser.execute_script(
        "return [...document.querySelectorAll('.chart .ylabel')].map((e) => e.textContent)"
    ) == [
        "acc (log)",
        "val_loss (log)",
    ]
    browser.find_element(By.ID, "logy").click()
    wait_for(browser, lambda b: attrs(b, ".chart svg", "data-scale") == ["linear", "linear"])


def test_optimizer_state_is_shown_under_its_parameters_name(browser: Any, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    with ckvc.Repo.init(tmp_path / "repo") as repo:
        repo.commit({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, message="adam")
    with contextlib.contextmanager(serving)(tmp_path / "repo") as server:
        open_page(browser, server, "commit/main", "commit")
        row = browser.find_element(By.CSS_SELECTOR, '#tensor-table tr[data-path="optimizer.state.3.exp_avg"]')
        assert row.find_element(By.CSS_SELECTOR, "td").text == "optimizer.state[model.1.bias].exp_avg"
        assert row.get_attribute("title") == "stored as optimizer.state.3.exp_avg"
        layers = attrs(browser, "#by-layer g.bar", "data-name")
        assert "optimizer.state[model.1]" in layers and "model.1" in layers
        browser.find_element(By.ID, "tensor-filter").send_keys("[model.2.weight]")
        wait_for(browser, lambda b: len(b.find_elements(By.CSS_SELECTOR, "#tensor-table tbody tr")) == 3)
        assert sorted(attrs(browser, "#tensor-table tbody tr", "data-path")) == [
            "optimizer.state.4.exp_avg",
            "optimizer.state.4.exp_avg_sq",
            "optimizer.state.4.step",
        ]


def test_a_token_server_opens_from_its_printed_url_and_keeps_the_token_out_of_sight(browser: Any, built: Built) -> None:
    token = "browser-test-token-0123456789"
    with contextlib.contextmanager(serving)(built.path, token) as server:
        browser.get(server.url + "history")
        assert "Unauthorized" in browser.page_source  # no token: the page is not served
        open_page(browser, server, f"commit/v2?token={token}", "commit")
        assert browser.current_url == server.url + "commit/v2"  # the token left the address bar
        assert browser.execute_script("return document.cookie") == ""  # HttpOnly: no script reads it
        assert attrs(browser, "#tensor-table tbody tr", "data-path")  # the API answered through the cookie
        browser.delete_all_cookies()


def test_commit_page_shows_notes_and_the_signer(browser: Any, tmp_path: Path) -> None:
    from ckvc import signing

    key = signing.generate_key(tmp_path / "alice")
    with ckvc.Repo.init(tmp_path / "repo") as repo:
        signing.set_trust(repo.core, "sign_key", str(key.path))
        signing.set_trust(repo.core, "trusted_keys", str(key.path) + ".pub")
        cid = repo.commit({"w": torch.ones(3)}, message="signed", metrics={"val_loss": 0.5}, sign=True)
        note = repo.note(cid, metrics={"eval_acc": 0.91}, message="held-out eval")
    with contextlib.contextmanager(serving)(tmp_path / "repo") as server:
        open_page(browser, server, "commit/main", "commit")
        shown = browser.find_element(By.CSS_SELECTOR, f'#commit-notes p.note[data-note="{note.id}"]')
        assert "eval_acc" in shown.text and "0.91" in shown.text and "held-out eval" in shown.text
        mark = browser.find_element(By.CSS_SELECTOR, "h1 .mark.signed")
        assert mark.text == "signed: alice"
