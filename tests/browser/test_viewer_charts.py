"""The run viewer's charts, version-lag colours, trace timeline and replay-bundle page in a real headless Chromium
(Playwright driving the OS's executable, as in `test_viewer_browser.py`), on synthetic folders
(`relax_pipeline/testing/run_folders.py`) whose values are chosen to break a naive chart: 24 steps, a loss near
-12,345 (the labels that were clipped at the left edge), rewards such as 0.2235 (the ticks that were not round),
an entropy that moves in its fifth decimal, a KL near 1e-8 and counts near a million (labels that must still tell
ticks apart), no pass-rate metric (the chart that was shown empty), version-lag shares, a session whose tokens and
turns come from older weights, and its trace in the OTLP/JSON files the run's tracing writes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relax_pipeline.testing.run_folders import step_rows, write_bundle, write_run_folder, write_traces
from tests.browser.pages import chromium, shot, viewer_page

playwright = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[view]' (playwright==1.65.2)")

STEPS = 24
LAGGED = "sess-23-3"
"""A session of the last step whose first turn was sampled one version behind: its trace and tokens show it."""
LAG_COLOURS = ["rgb(140, 233, 154)", "rgb(255, 224, 102)"]
AXES = """el => {
  const u = el.uplot, y = u.axes[1];
  u.ctx.font = y.font[0];
  const widest = Math.max(...y._values.map((v) => u.ctx.measureText(v).width / devicePixelRatio));
  return {splits: y._splits, values: y._values, left: y._pos - y.ticks.size - y.gap - widest,
          xsplits: u.axes[0]._splits, series: u.series.slice(1).map((s) => s.label)};
}"""


def lag_metrics(step: int) -> dict[str, float]:
    old = min(step, 6) / 20
    shares = {"0": 1 - old, "1": old * 0.6, "2": old * 0.3, "3": old * 0.1, "4+": 0.0}
    mean = sum(int(k.rstrip("+")) * v for k, v in shares.items())
    return {**{f"train/version_lag/{k}": v for k, v in shares.items()}, "train/version_lag/mean": mean}


def step_metrics(step: int) -> dict[str, float]:
    return {"rollout/raw_reward": 0.2235 + 0.01493 * step, "train/loss": -12345.678 + 37.1 * step,
            "train/entropy": 7.2965 + 0.00002 * step, "train/ppo_kl": 2e-8 * (1 + step / 10),
            "rollout/fork_count": 1e6 + 5e4 * step, "train/weight_version": float(step + 1), **lag_metrics(step)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_run_folder(tmp_path_factory.mktemp("charts") / "run", steps=STEPS, sessions=8)
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": 0.0, "metrics": step_metrics(s)}) + "\n"
                                                for s in range(STEPS)))
    dump = root / "dump" / f"rollout_{STEPS - 1}.jsonl"
    rows = [json.loads(line) for line in dump.read_text().splitlines()]
    for row in rows:
        if row["session_id"] == LAGGED:
            half = len(row["weight_versions"]) // 2
            row["weight_versions"] = [STEPS - 2] * half + [STEPS - 1] * (len(row["weight_versions"]) - half)
    dump.write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_traces(root, STEPS - 1, {"sess-23-2": [STEPS - 1], LAGGED: [STEPS - 2, STEPS - 1]}, abort_turn=1)
    return root


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def page(browser: Any, folder: Path) -> Iterator[Any]:
    yield from viewer_page(browser, folder)


def charts(page: Any) -> dict[str, dict[str, Any]]:
    page.goto(page.base + "#/curves")
    page.wait_for_selector('[data-chart="Loss"] canvas')
    cards = page.locator(".chart")
    return {cards.nth(i).get_attribute("data-chart"): cards.nth(i).evaluate(AXES) for i in range(cards.count())}


def shown(value: float) -> float:
    """A number as the page shows it (4 significant digits)."""
    return float(f"{value:.4g}")


def label_value(label: str) -> float:
    """A tick label read back as a number (`1.2M`, `-12250`, `2.5e-8`, `75%`)."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "%": 0.01}.get(label[-1], 1)
    return float(label.rstrip("KMB%")) * scale


def is_round(splits: list[float]) -> bool:
    """Evenly spaced ticks, each a whole multiple of a step of 1, 2, 2.5 or 5 times a power of ten."""
    step = splits[1] - splits[0]
    mantissa = float(f"{step:.6e}".split("e")[0])
    return (any(abs(mantissa - m) < 1e-6 for m in (1, 2, 2.5, 5))
            and all(abs(b - a - step) < step * 1e-6 for a, b in zip(splits, splits[1:], strict=False))
            and all(abs(v / step - round(v / step)) < 1e-6 for v in splits))


def test_charts_have_round_ticks_and_labels_inside_the_canvas(page: Any) -> None:
    found = charts(page)
    assert {"Reward", "Loss", "Entropy", "KL", "Fork count", "Mean version lag",
            "Version lag (share of trained tokens)"} <= set(found)
    for title, axes in found.items():
        assert len(axes["splits"]) >= 2 and is_round(axes["splits"]), (title, axes["values"])
        assert axes["left"] >= 0, f"{title}: the widest y label starts {axes['left']:.1f}px left of the canvas"
        assert all(float(x) == int(x) for x in axes["xsplits"]), f"{title}: a step tick between steps"
        step = axes["splits"][1] - axes["splits"][0]
        read = [label_value(v) for v in axes["values"]]
        assert all(abs(r - v) < step / 2 for r, v in zip(read, axes["splits"], strict=True)), (title, axes["values"])
    loss = found["Loss"]["values"]
    assert all(v.startswith("-") for v in loss) and all(len(v.lstrip("-").split(".")[0]) == 5 for v in loss), loss
    assert not any(v in found["Reward"]["values"] for v in ("0.2235", "0.373", "0.5224"))
    shot(page, "charts")


def test_a_chart_without_data_is_not_shown(page: Any) -> None:
    charts(page)
    assert page.locator('[data-chart="Pass rate"]').count() == 0
    assert "Pass rate" in page.inner_text("#no-data")


def test_hover_shows_the_value_and_drag_zooms_and_a_refresh_keeps_it_until_double_click(page: Any) -> None:
    charts(page)
    card = page.locator('[data-chart="Reward"]')
    over = card.locator(".u-over").bounding_box()
    page.mouse.move(over["x"] + over["width"] - 1, over["y"] + over["height"] / 2)
    legend = card.locator(".u-legend .u-series").nth(1)
    assert legend.locator(".u-label").inner_text() == "rollout/raw_reward"
    assert float(legend.locator(".u-value").inner_text()) == shown(0.2235 + 0.01493 * (STEPS - 1))
    scale = "el => [el.uplot.scales.x.min, el.uplot.scales.x.max]"
    assert card.evaluate(scale) == [0, STEPS - 1]
    page.mouse.move(over["x"] + over["width"] * 0.25, over["y"] + 20)
    page.mouse.down()
    page.mouse.move(over["x"] + over["width"] * 0.6, over["y"] + 20, steps=5)
    page.mouse.up()
    low, high = card.evaluate(scale)
    assert 0 < low < high < STEPS - 1, "dragging zoomed in"
    page.evaluate("document.querySelector('[data-chart=\"Reward\"]').uplot.marked = 1")
    page.click("#refresh")
    page.wait_for_function("!document.querySelector('[data-chart=\"Reward\"]').uplot.marked")
    card = page.locator('[data-chart="Reward"]')
    assert card.evaluate(scale) == [low, high], "a refresh keeps the zoom"
    page.mouse.dblclick(over["x"] + over["width"] / 2, over["y"] + 20)
    assert card.evaluate(scale) == [0, STEPS - 1], "double-click resets"


def test_version_lag_is_a_stacked_share_with_each_lag_in_the_legend(page: Any) -> None:
    charts(page)
    card = page.locator('[data-chart="Version lag (share of trained tokens)"]')
    labels = card.evaluate("el => el.uplot.series.slice(1).map((s) => s.label)")
    assert labels == ["lag 4+", "lag 3", "lag 2", "lag 1", "lag 0"]
    top = card.evaluate("el => el.uplot.data[1]")
    assert all(abs(v - 1) < 1e-9 for v in top), "the running total of every lag is the whole step"
    over = card.locator(".u-over").bounding_box()
    page.mouse.move(over["x"] + over["width"] - 1, over["y"] + over["height"] / 2)
    values = card.locator(".u-legend .u-series .u-value").all_inner_texts()[1:]
    assert values == ["0.0%", "3.0%", "9.0%", "18.0%", "70.0%"]


def test_the_session_page_shows_its_trace_as_a_timeline(page: Any, folder: Path) -> None:
    page.goto(page.base + f"#/session/{STEPS - 1}/{LAGGED}")
    page.wait_for_selector("#timeline .span")
    spans = page.locator("#timeline .span")
    names = spans.evaluate_all("els => els.map((e) => e.dataset.name)")
    assert names.count("turn") == 2 and {"session", "queue", "prefill", "decode", "abort", "resume", "agent_gap",
                                         "export", "reward", "credit", "train_step", "micro_batch"} <= set(names)
    rows = spans.evaluate_all("els => els.map((e) => [e.dataset.name, +e.dataset.depth, +e.dataset.row])")
    assert {(d, r) for n, d, r in rows if n == "session"} == {(0, 0)}
    assert {(d, r) for n, d, r in rows if n in ("turn", "agent_gap", "train_step")} == {(1, 1)}
    assert {(d, r) for n, d, r in rows if n in ("decode", "micro_batch")} == {(2, 2)}
    boxes = spans.evaluate_all("els => els.map((e) => e.getBoundingClientRect()).map((b) => [b.left, b.right])")
    area = page.locator("#timeline .bars").bounding_box()
    assert all(area["x"] - 0.5 <= left and right <= area["x"] + area["width"] + 2.5 for left, right in boxes)
    first_turn = page.locator('#timeline .span[data-name="turn"]').first
    assert first_turn.get_attribute("data-lag") == "1"
    assert first_turn.evaluate("e => getComputedStyle(e).backgroundColor") == LAG_COLOURS[1]
    first_turn.hover()
    tip = page.inner_text("#tip")
    assert tip.startswith("turn · 15 ms (from +0 ms)") and f"relax.weight_version = {STEPS - 2}" in tip
    shot(page, "trace")
    export = page.locator('#timeline .span[data-name="export"]')
    export.click()
    zoomed = page.locator("#timeline").evaluate("e => [+e.dataset.from, +e.dataset.to]")
    assert zoomed == [40.0, 41.0], "clicking a span zooms the timeline to it"
    assert export.bounding_box()["width"] == pytest.approx(area["width"], abs=3)
    page.locator("#timeline .bars").dblclick(position={"x": 5, "y": 5})
    assert page.locator("#timeline").evaluate("e => [+e.dataset.from, +e.dataset.to]") == [0, 64.0]


def test_tokens_are_coloured_by_their_lag_behind_the_step_that_trained_them(page: Any) -> None:
    page.goto(page.base + f"#/session/{STEPS - 1}/{LAGGED}")
    page.wait_for_selector("#ctx-0 .tok.resp")
    page.check('#color-mode input[value="lag"]')
    tokens = page.locator("#ctx-0 .tok.resp")
    seen = tokens.evaluate_all("els => els.map((e) => [e.dataset.lag, getComputedStyle(e).backgroundColor])")
    half = len(seen) // 2
    assert [lag for lag, _ in seen] == ["1"] * half + ["0"] * (len(seen) - half)
    assert {colour for lag, colour in seen if lag == "1"} == {LAG_COLOURS[1]}
    assert {colour for lag, colour in seen if lag == "0"} == {LAG_COLOURS[0]}
    tokens.first.hover()
    assert "lag 1" in page.inner_text("#tip")
    page.check('#color-mode input[value="mask"]')


def test_a_session_without_a_trace_says_why(page: Any) -> None:
    page.goto(page.base + f"#/session/{STEPS - 2}/sess-22-3")
    page.wait_for_selector("#no-trace")
    assert page.inner_text("#no-trace") == "no trace recorded (tracking.traces=false?)"


def test_a_replay_bundle_opens_directly_with_its_credit_and_loss(browser: Any, tmp_path: Path) -> None:
    import random

    rows = step_rows(random.Random(3), 5, 6, fork_every=0, fail_every=0, response=8)
    bundle = write_bundle(tmp_path / "replay" / "step_5", 5, rows, {"train/loss": -0.0123, "train/grad_norm": 0.5})
    for page in viewer_page(browser, bundle):
        page.goto(page.base)
        page.wait_for_selector("#credit tr[data-session]")
        assert "replay bundle of step 5" in page.inner_text("#folder")
        table = page.locator("#credit tr[data-session]")
        assert table.count() == len(rows)
        advantages = table.locator("td.advantage").all_inner_texts()
        assert [float(a) for a in advantages] == [shown(r["advantage"]) for r in rows]
        assert "train/loss\n-0.0123" in page.inner_text("#bundle-metrics")
        shot(page, "bundle_fixture")
        table.first.locator("a").click()
        page.wait_for_selector(f'h2:has-text("{rows[0]["session_id"]}")')
        assert page.locator("#ctx-0 .tok").count() == len(rows[0]["tokens"])
        page.goto(page.base + "#/curves")
        page.wait_for_selector('[data-chart="Loss"] canvas')
        assert page.locator('[data-chart="Loss"]').evaluate("el => el.uplot.data") == [[5], [-0.0123]]
