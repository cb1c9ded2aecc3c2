"""The run viewer in a real headless browser: Chromium from the OS (`apt-get install chromium`) driven by Playwright
for Python (`pip install -e '.[view]'`; no `playwright install` download: the OS's executable is launched).

The run: two training steps on the tiny model (CPU) with `tests/agents/forking_agent.py`, which forks its session
on "+" prompts (it rewrites its first answer), fails on purpose on one prompt (a failed and a dropped row), and
an eval dataset evaluated before the first step and after each; it writes a replay bundle per step. The tests open
that run's folder (and its last bundle) in the viewer and check what a person would look at; each view is saved as
a screenshot (`tests/browser/pages.py`: into `docs/img/viewer_*.png`, which the README shows, when
`RELAX_SCREENSHOTS=docs` is set). Regenerate the README's images with
`RELAX_SCREENSHOTS=docs pytest -m browser tests/browser`. The charts' own checks (round ticks, labels inside the
canvas, hover, zoom, version lag, the trace timeline) are in `test_viewer_charts.py`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run
from tests.browser.pages import REPO, chromium, shot, viewer_page

playwright = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[view]' (playwright==1.65.2)")
AGENT = REPO / "tests" / "agents" / "forking_agent.py"
STEPS = 2
PROMPTS = ["What is 2 + 3?", "What is 7 - 4?", "Please fail now.", "What is 5 + 1?", "What is 9 - 2?", "What is 4 + 4?"]
MASK_COLOURS = {"1": "rgb(199, 236, 210)", "0": "rgb(228, 232, 238)"}
VERSION_COLOURS = {0: "rgb(207, 226, 255)", 1: "rgb(255, 216, 168)"}


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
            "eval.interval=1", "eval.n_samples_per_prompt=1", f"eval.datasets=[{{name:toy,path:{evals}}}]",
            "debug.replay_bundle=true"]))
    run(cfg)
    return folder / "out"


@pytest.fixture(scope="module")
def browser(run_dir: Path) -> Iterator[Any]:
    """Chromium, started after the run: Playwright's sync API holds an event loop, and `run` starts its own."""
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser: Any, run_dir: Path) -> Iterator[Any]:
    yield from viewer_page(browser, run_dir)


def rows_of(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "dump" / f"rollout_{step}.jsonl").read_text().splitlines()]


def points(page: Any, chart: str, series: str) -> list[list[float]]:
    """(step, value) of each point of `series` in the chart `chart` (its uPlot data, nulls left out)."""
    return page.locator(f'[data-chart="{chart}"]').evaluate(
        """(el, name) => { const u = el.uplot, i = u.series.findIndex((s) => s.label === name);
          return i < 1 ? [] : u.data[0].map((x, j) => [x, u.data[i][j]]).filter(([, y]) => y !== null); }""", series)


def test_each_curve_has_one_point_per_step(page: Any, run_dir: Path) -> None:
    page.goto(page.base + "#/curves")
    page.wait_for_selector('[data-chart="Reward"] canvas')
    for chart, series in [("Reward", "rollout/raw_reward"), ("Loss", "train/loss"), ("Entropy", "train/entropy"),
                          ("Truncated ratio", "rollout/truncated_ratio"), ("Fork count", "rollout/fork_count"),
                          ("Step time (s)", "perf/step_time"), ("Mean version lag", "train/version_lag/mean")]:
        assert [x for x, _ in points(page, chart, series)] == [0, 1], chart
    assert len(points(page, "Eval accuracy", "eval/toy/raw_reward")) == STEPS + 1, "eval before step 0 and after each"
    assert points(page, "Fork count", "rollout/fork_count")[-1][1] > 0
    assert points(page, "Version lag (share of trained tokens)", "lag 0") == [[0, 1.0], [1, 1.0]], "sync: no lag"
    logged = {k for line in (run_dir / "metrics.jsonl").read_text().splitlines() for k in json.loads(line)["metrics"]}
    assert not logged & {"passrate", "rollout/sampled_passrate"}
    assert page.locator('[data-chart="Pass rate"]').count() == 0, "a chart without data is not shown"
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
    page.wait_for_selector('[data-chart="Reward"] canvas')
    assert len(points(page, "Reward", "rollout/raw_reward")) == STEPS
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:  # what the next step of a running run adds
        f.write(json.dumps({"step": STEPS, "time": 0.0, "metrics": {"rollout/raw_reward": 0.5}}) + "\n")
    page.click("#refresh")
    page.wait_for_function(f"document.querySelector('[data-chart=\"Reward\"]').uplot.data[0].length === {STEPS + 1}")


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


def test_the_run_s_replay_bundle_opens_directly(browser: Any, run_dir: Path) -> None:
    """`job=view view.dir=<output>/replay/step_1`: the bundle's manifest, loss and per-context advantages, as the
    run's recorder wrote them, and its sessions open with their tokens."""
    bundle = run_dir / "replay" / f"step_{STEPS - 1}"
    credit = [c for line in (bundle / "credit.jsonl").read_text().splitlines() for c in json.loads(line)["contexts"]]
    loss = json.loads((bundle / "metrics.json").read_text())["train/loss"]
    for page in viewer_page(browser, bundle):
        page.goto(page.base)
        page.wait_for_selector("#credit tr[data-session]")
        rows = page.locator("#credit tr[data-session]")
        assert rows.evaluate_all("els => els.map((e) => e.dataset.session)") == [c["session_id"] for c in credit]
        shown = [float(a) for a in rows.locator("td.advantage").all_inner_texts()]
        assert shown == [float(f"{c['advantage']:.4g}") for c in credit]
        assert float(page.inner_text('#bundle-metrics dt:text-is("train/loss") + dd')) == float(f"{loss:.4g}")
        shot(page, "bundle")
        rows.first.locator("a").click()
        page.wait_for_selector("#ctx-0 .tok.resp")


def test_a_session_s_trace_from_the_run_shows_each_turn_on_its_timeline(page: Any, run_dir: Path) -> None:
    """The run writes its traces (`tracking.traces`, on by default): a session's page lays out its spans, one
    `turn` bar per model turn of its row, coloured by its lag behind the step's trained version (0 here: sync)."""
    row = next(r for r in rows_of(run_dir, 0) if r["branch"] is None and r["turn_count"])
    page.goto(page.base + f"#/session/0/{row['session_id']}")
    page.wait_for_selector("#timeline .span")
    turns = page.locator('#timeline .span[data-name="turn"]')
    assert turns.count() == row["turn_count"]
    assert set(turns.evaluate_all("els => els.map((e) => e.dataset.lag)")) == {"0"}
    names = set(page.locator("#timeline .span").evaluate_all("els => els.map((e) => e.dataset.name)"))
    assert {"session", "turn", "decode", "export", "reward", "train_step", "micro_batch"} <= names
    turns.first.hover()
    assert page.inner_text("#tip").startswith("turn · ")
    shot(page, "trace_run")
