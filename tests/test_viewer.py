"""`mtrl view` in a real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright): the page
served for a real run whose agent fails half its rollouts, and a static page of markup-laden text.
The data behind the page: tests/test_viewer_data.py."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from test_viewer_data import MARKUP, TOOL_RESULT, hand_built_store

from pipeline.cli.main import main
from pipeline.orchestration.flows import rl_training
from pipeline.orchestration.stage_table import ROOT
from schemas.config import RunConfig

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
# As root and offline: no sandbox (it refuses root otherwise), no GPU, nothing that calls home.
# Playwright adds --headless and a fresh --user-data-dir of its own.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
GREEN, RED, ORANGE = "rgba(26, 127, 55", "rgba(207, 34, 46", "rgba(230, 120, 0"  # the page's colours


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail(
            f"no Chromium at {CHROMIUM}: the viewer's tests drive a real browser. Install it with `make browser` "
            "(as root, it runs `apt-get install -y chromium chromium-driver`) or your system's chromium package."
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("Playwright for Python is missing: pip install -e '.[dev]' (no `playwright install` needed)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def agent_run(tmp_path_factory, prefect_server) -> Path:
    """One iteration of 2 groups x 4 rollouts through an agent that raises on the odd rollouts."""
    runs = tmp_path_factory.mktemp("viewer") / "runs"
    agent = {"function": "tests.agent_programs:raises"}
    rl_training(RunConfig(iterations=1, task={"rollouts": 8, "group_size": 4}, agent=agent, store={"runs_dir": runs}))
    return runs


@contextmanager
def served(runs: Path) -> Iterator[str]:
    """`mtrl view RUNS --port 0` in a child process; yields the address it prints."""
    command = [sys.executable, "-m", "pipeline.cli", "view", str(runs), "--port", "0"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        address = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert address, f"mtrl view printed {line!r}"
        yield address.group(0)
    finally:
        process.terminate()
        process.wait(timeout=30)


def opened(browser, url: str):
    """A page at url; returns it and the list its script errors and dialogs are appended to."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"error: {error}"))
    page.on("dialog", lambda dialog: problems.append(f"dialog: {dialog.message}"))
    page.goto(url)
    return page, problems


def test_the_served_page_lists_the_groups_opens_a_rollouts_turns_and_tokens_and_shows_failures(browser, agent_run):
    with served(agent_run) as url:
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"{url}?iteration=7")
        page, problems = opened(browser, url)
        assert "iteration 0" in page.locator("#meta").inner_text() and "4 failed" in page.locator("#meta").inner_text()
        assert page.locator("section.group").count() == 2 and page.locator(".rollout").count() == 8

        rollout = page.locator(".rollout:not(.failed)").first
        assert rollout.locator(".badge", has_text="agent").count() == 1
        assert rollout.locator(".turn").count() == 0  # the turns are rendered when opened
        rollout.locator("details.turns > summary").click()
        rollout.locator(".turn").first.wait_for()  # rendered on the details' toggle event, just after the click
        assert rollout.locator(".msg.assistant").first.is_visible()
        token = rollout.locator(".tok").first
        token.hover()
        assert re.fullmatch(
            r"token \d+ .*\nlogprob -?\d+\.\d{4} \(p = [\d.]+\)\nadvantage [+-]?\d\.\d{4}", token.get_attribute("title")
        )
        colour = token.get_attribute("style")
        assert GREEN in colour or RED in colour, colour  # GRPO: +-0.707 on every token of a rollout
        page.select_option("#colour-by", "logprob")
        assert ORANGE in token.get_attribute("style")

        failed = page.locator(".rollout.failed")
        assert failed.count() == 4
        assert "the agent raised RuntimeError: the agent's own bug" in failed.first.locator("pre.failure").inner_text()
        assert failed.first.locator("pre.failure").is_visible()  # without opening it
        assert not problems, problems
        page.close()


def test_a_static_page_opens_from_a_file_and_shows_the_models_markup_as_text(browser, tmp_path):
    out = tmp_path / "view.html"
    assert main(["view", str(hand_built_store(tmp_path / "runs").root), "--out", str(out)]) == 0
    page, problems = opened(browser, out.as_uri())
    native, agent, failed = (page.locator(f'.rollout[data-rollout-id="{i}"]') for i in range(3))
    page.locator("section.group button").click()  # open all
    failed.locator(".turn").wait_for()  # the last one rendered
    assert native.locator(".msg.assistant .content").inner_text() == MARKUP
    assert agent.locator(".msg.tool pre").inner_text() == TOOL_RESULT
    assert page.locator("main img").count() == 0 and agent.locator(".msg.tool b").count() == 0
    assert agent.locator(".turn .segment").inner_text() == "new segment"
    assert "boom <i>here</i>" in failed.locator("pre.failure").inner_text()
    assert not problems, problems
    page.close()
