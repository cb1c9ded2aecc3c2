"""The run viewer in a real headless browser: Chromium from the OS (`apt-get install chromium`) driven by Playwright
for Python (`pip install -e '.[view]'`; no `playwright install` download: the OS's executable is launched).

The run: two training steps on the tiny model (CPU) with `tests/agents/forking_agent.py`, which forks its session
on "+" prompts (it rewrites its first answer), fails on purpose on one prompt (a failed and a dropped row), and
an eval dataset evaluated before the first step and after each. The tests open that run's folder in the viewer
and check what a person would look at; each view is saved as a screenshot, into `docs/img/viewer_*.png` (the README
shows them) when `RELAX_SCREENSHOTS=docs` is set, else into the test's temporary folder, so a test run leaves the
checkout clean. Regenerate the README's images with `RELAX_SCREENSHOTS=docs pytest -m browser tests/browser`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run
from relax_pipeline.view.server import ViewServer

playwright = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[view]' (playwright==1.65.2)")
REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "docs" / "img" if os.environ.get("RELAX_SCREENSHOTS") == "docs" else Path(tempfile.mkdtemp("-viewer"))
AGENT = REPO / "tests" / "agents" / "forking_agent.py"
STEPS = 2
PROMPTS = ["What is 2 + 3?", "What is 7 - 4?", "Please fail now.", "What is 5 + 1?", "What is 9 - 2?", "What is 4 + 4?"]
MASK_COLOURS = {"1": "rgb(199, 236, 210)", "0": "rgb(228, 232, 238)"}
VERSION_COLOURS = {0: "rgb(207, 226, 255)", 1: "rgb(255, 216, 168)"}


def chromium() -> str:
    for name in (os.environ.get("RELAX_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and (path := shutil.which(name)):
            return path
    pytest.skip("no Chromium on PATH: apt-get install -y chromium (or set RELAX_CHROMIUM)")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, tiny_path: Path) -> Path:
    """A two-step CPU training run with forks, a failure and eval, written to a tmp folder."""
    folder = tmp_path_factory.mktemp("viewed-run")
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps({"input": p, "metadata": {}}) + "\n" for p in PROMPTS))
    evals = folder / "eval.jsonl"
    evals.write_text("".join(json.dumps({"input": p, "metadata": {}}) + "\n" for p in PROMPTS[:2]))
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=quote_placeholders([
            "job=train", "agent=minimal", f"agent.command='{os.sys.executable} {AGENT}'", "dataset=toy",
            f"dataset.path={data}", f"rollout.num_steps={STEPS}", "rollout.batch_size=2",
            "rollout.n_samples_per_prompt=2", "rollout.max_response_len=16", f"output_dir={folder / 'out'}",
            f"model.cache_dir={tiny_path.parent}", "debug.save_rollout_data=dump/rollout_{rollout_id}.jsonl",
            "eval.interval=1", "eval.n_samples_per_prompt=1", f"eval.datasets=[{{name:toy,path:{evals}}}]"]))
    run(cfg)
    return folder / "out"


@pytest.fixture(scope="module")
def page(run_dir: Path) -> Iterator[Any]:
    server = ViewServer(run_dir).start()
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.base = server.url
        yield page
        browser.close()
        server.stop()
    assert not errors, f"the page raised: {errors}"


def rows_of(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "dump" / f"rollout_{step}.jsonl").read_text().splitlines()]


def shot(page: Any, name: str) -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(IMAGES / f"viewer_{name}.png"), full_page=True)


def test_each_curve_has_one_point_per_step(page: Any) -> None:
    page.goto(page.base + "#/curves")
    page.wait_for_selector('[data-chart="Reward"] svg')
    for chart, series in [("Reward", "rollout/raw_reward"), ("Loss", "train/loss"), ("Entropy", "train/entropy"),
                          ("Truncated ratio", "rollout/truncated_ratio"), ("Fork count", "rollout/fork_count"),
                          ("Step time (s)", "perf/step_time")]:
        points = page.locator(f'[data-chart="{chart}"] circle.point[data-series="{series}"]')
        assert points.count() == STEPS, chart
        assert [points.nth(i).get_attribute("data-step") for i in range(STEPS)] == ["0", "1"]
    evals = page.locator('[data-chart="Eval accuracy"] circle.point[data-series="eval/toy/raw_reward"]')
    assert evals.count() == STEPS + 1, "eval before the first step and after each"
    forks = page.locator('[data-chart="Fork count"] circle.point')
    assert float(forks.nth(STEPS - 1).get_attribute("data-value")) > 0
    shot(page, "curves")


def test_status_filter_shows_only_that_status_with_its_reason(page: Any, run_dir: Path) -> None:
    rows = rows_of(run_dir, 0)
    page.goto(page.base + "#/steps/0")
    page.wait_for_selector("#sessions tbody tr")
    assert page.locator("tr.session-row").count() == len({r["session_id"] for r in rows})
    shot(page, "sessions")
    page.click('a.chip[data-status="failed"]')
    page.wait_for_selector('a.chip.active[data-status="failed"]')
    failed = [r for r in rows if r["status"] == "failed"]
    shown = page.locator("tr.session-row")
    assert failed and shown.count() == len(failed)
    assert {shown.nth(i).get_attribute("data-status") for i in range(shown.count())} == {"failed"}
    assert "fails on purpose" in shown.first.inner_text()
    page.click('a.chip[data-status="dropped"]')
    page.wait_for_selector('a.chip.active[data-status="dropped"]')
    assert page.locator("tr.session-row").count() == sum(r["status"] == "dropped" for r in rows)


def forked_session(run_dir: Path, step: int) -> str:
    return next(r["session_id"] for r in rows_of(run_dir, step) if r["branch"] == 1)


def test_a_forked_session_shows_both_branches_and_why_it_forked(page: Any, run_dir: Path) -> None:
    session = forked_session(run_dir, 1)
    page.goto(page.base + "#/steps/1")
    page.click(f'tr.session-row[data-session="{session}"]')
    page.wait_for_selector("#tree")
    leaves = page.locator("#tree .leaf").all_inner_texts()
    assert len(leaves) == 2 and leaves[0].startswith("branch 0") and leaves[1].startswith("branch 1")
    fork = page.locator("#tree .fork")
    assert fork.count() == 1 and "differs in content" in fork.inner_text()
    assert page.locator("#tree").get_by_text("Let me start over.").count() == 1
    assert page.locator(".context").count() == 2


def test_tokens_are_coloured_by_loss_mask_and_by_weight_version_with_logprob_on_hover(page: Any, run_dir: Path
                                                                                     ) -> None:
    session = forked_session(run_dir, 1)
    row = next(r for r in rows_of(run_dir, 1) if r["session_id"] == session and r["branch"] == 0)
    page.goto(page.base + f"#/session/1/{session}")
    page.wait_for_selector(f'h2:has-text("{session}")')
    tokens = page.locator("#ctx-0 .tok")
    assert tokens.count() == len(row["tokens"])
    response = page.locator("#ctx-0 .tok.resp")
    masks = response.evaluate_all("els => els.map(e => [e.dataset.mask, getComputedStyle(e).backgroundColor])")
    assert [int(m) for m, _ in masks] == row["loss_mask"] and {"0", "1"} <= {m for m, _ in masks}
    assert all(colour == MASK_COLOURS[m] for m, colour in masks)
    response.first.hover()
    tip = page.locator("#tip")
    assert f"logprob {row['rollout_logprobs'][0]:.4f}" in tip.inner_text() and "weight v1" in tip.inner_text()
    shot(page, "session")
    page.check('#color-mode input[value="version"]')
    colours = response.evaluate_all("els => [...new Set(els.map(e => getComputedStyle(e).backgroundColor))]")
    assert colours == [VERSION_COLOURS[1]] and set(row["weight_versions"]) == {1}
    earlier = next(r["session_id"] for r in rows_of(run_dir, 0) if r["turn_count"])
    page.goto(page.base + f"#/session/0/{earlier}")
    page.wait_for_selector(f'h2:has-text("{earlier}")')
    assert page.locator("#ctx-0 .tok.resp").first.evaluate("e => getComputedStyle(e).backgroundColor") == \
        VERSION_COLOURS[0]
    shot(page, "versions")


def test_refresh_shows_a_step_the_run_wrote_after_the_page_opened(page: Any, run_dir: Path) -> None:
    page.goto(page.base + "#/curves")
    points = page.locator('[data-chart="Reward"] circle.point[data-series="rollout/raw_reward"]')
    points.first.wait_for()
    assert points.count() == STEPS
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:  # what the next step of a running run adds
        f.write(json.dumps({"step": STEPS, "time": 0.0, "metrics": {"rollout/raw_reward": 0.5}}) + "\n")
    page.click("#refresh")
    page.wait_for_function(f"document.querySelectorAll('[data-chart=\"Reward\"] circle.point"
                           f"[data-series=\"rollout/raw_reward\"]').length === {STEPS + 1}")


def test_the_check_page_shows_the_verdict_and_the_worst_turn_s_token_diff(page: Any, run_dir: Path) -> None:
    """A certificate written by certify's own writer: the page shows the verdict, the stages, the causes and the
    worst turn (the first drift that forked a session), its first differing token marked on both sides."""
    from relax_pipeline.certify.certificate import Cause, Stage, certificate, write

    absorbed = {"session": "s1", "turn": 1, "cause": "whitespace", "forked": False, "tokens_duplicated": 0,
                "tokens_lost": 0, "first_difference": {"cause": "whitespace", "token_index": 3, "message_index": 1,
                                                       "held": "a⟦ ⟧b", "rendered": "a⟦  ⟧b", "held_token": " ",
                                                       "rendered_token": "  "}}
    difference = {"cause": "reasoning_dropped", "token_index": 12, "message_index": 2,
                  "held": "assistant\n⟦<think>⟧plan", "rendered": "assistant\n⟦The⟧ answer", "held_token": "<think>",
                  "rendered_token": "The"}
    forked = {"session": "s2", "turn": 2, "cause": "reasoning_dropped", "forked": True, "tokens_duplicated": 40,
              "tokens_lost": 0, "first_difference": difference}
    template = Stage("template", "warn", "2 of 4 turns re-render differently",
                     {"first_differences": [absorbed, forked]})
    causes = [Cause("reasoning_dropped", 1, 1, 40, 0, 0.25, "rollout.history=tokens")]
    cert = certificate([Stage("config", "pass", "ok"), template], causes, {"model": "tiny"})
    write(cert, run_dir)
    page.goto(page.base + "#/check")
    page.wait_for_selector("#worst mark.first-diff")
    assert page.inner_text("#verdict") == cert.verdict == "degraded"
    worst = page.inner_text("#worst")
    assert "session s2, turn 2: reasoning_dropped (forked the session)" in worst
    assert page.locator("#worst mark.first-diff").all_inner_texts() == ["<think>", "The"]
    assert "rollout.history=tokens" in page.inner_text("#check-causes")
    shot(page, "check")
