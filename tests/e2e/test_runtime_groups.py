"""Runtime groups per credit, in every runtime mode: an ordinary reward runs singleton runtime groups (no session
waits for its siblings' first requests), `credit=group_rm` keeps the whole prompt group behind its first-request
barrier. Credit still takes the whole prompt group either way.

Real gateway, real agent subprocesses (a small agent written below: session 1 of each group starts late), real
stages and strategies on the paced engine; each combination of the runtime switches runs two rollout steps under
both credits. The check is an order of events, not a time: under an ordinary reward, session 0's first answer
comes before its late sibling even asks; under group RM, after.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.run import run
from relax_pipeline.testing.engines import register_paced

LATE_S = 1.5
"""Start-up delay of each group's session 1 (session 0 starts at once)."""

AGENT = f'''
import json, os, time, urllib.request
io = os.environ["RELAX_SESSION_IO_DIR"]
time.sleep({LATE_S} if io.endswith("-1") else 0.0)
def event(name):
    with open(os.path.join(io, "events.jsonl"), "a") as f:
        f.write(json.dumps({{"event": name, "t": time.time()}}) + "\\n")
body = json.dumps({{"model": "policy", "max_tokens": 8, "messages": [{{"role": "user", "content": "hi"}}]}})
request = urllib.request.Request(os.environ["RELAX_BASE_URL"].rstrip("/") + "/v1/chat/completions", body.encode(),
                                 {{"Content-Type": "application/json",
                                   "Authorization": "Bearer " + os.environ["RELAX_API_KEY"]}})
event("request")
urllib.request.urlopen(request, timeout=600).read()
event("response")
with open(os.environ["RELAX_OUTPUT_JSON"], "w") as f:
    json.dump({{"reward": 1.0}}, f)
'''

MODES = {
    "sync": ("runtime=sync",),
    "prelaunch": ("runtime=prelaunch",),
    "partial": ("runtime=partial",),
    "prelaunch+partial": ("runtime=prelaunch", "runtime.partial_rollout=true"),
    "fully_async": ("runtime=fully_async",),
    "fully_async+partial": ("runtime=fully_async", "runtime.partial_rollout=true"),
}
"""Every combination of `runtime.prelaunch`, `runtime.partial_rollout` and `runtime.fully_async` that starts
(prelaunch with fully_async is refused at start, `scheduling/settings.py`)."""


def _cfg(tmp_path: Path, tiny_path: Path, credit: str, mode: tuple[str, ...]) -> DictConfig:
    agent = tmp_path / "late_sibling_agent.py"
    agent.write_text(AGENT)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input": f"task {i}"}) + "\n" for i in range(4)))
    register()
    register_paced()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders([
            "job=rollout", f"output_dir={tmp_path}", f"model.cache_dir={tiny_path.parent}", f"dataset.path={data}",
            "dataset.shuffle=false", "agent=long_tail", f"agent.command='{sys.executable} {agent}'",
            f"agent.cwd={tmp_path}", "engine=paced", "engine.token_s=0.001", f"credit={credit}", *mode,
            "rollout.num_steps=2", "rollout.batch_size=1", "rollout.n_samples_per_prompt=2",
            f"debug.save_rollout_data={tmp_path}/r_{{rollout_id}}.jsonl",
        ]))


def _times(tmp_path: Path, group_id: str, index: int) -> dict[str, float]:
    lines = (tmp_path / "sessions" / f"{group_id}-{index}" / "events.jsonl").read_text().splitlines()
    return {e["event"]: e["t"] for e in map(json.loads, lines)}


def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for p in sorted(tmp_path.glob("r_*.jsonl")) for line in p.read_text().splitlines()]


@pytest.mark.parametrize("credit", ["reward", "group_rm"])
@pytest.mark.parametrize("mode", list(MODES))
def test_ordinary_reward_runs_singleton_runtime_groups_and_group_rm_whole_groups(
        tmp_path: Path, tiny_path: Path, mode: str, credit: str) -> None:
    run(_cfg(tmp_path, tiny_path, credit, MODES[mode]))
    rows = [r for r in _rows(tmp_path) if r["status"] in ("completed", "truncated")]
    assert len(rows) >= 4, "two steps of one group of two sessions each were scored"
    first = {r["group_id"] for r in rows if r["group_id"].startswith("g0-")}
    assert first, "the first step's group was scored"
    for group_id in first:
        answered, late_asked = _times(tmp_path, group_id, 0)["response"], _times(tmp_path, group_id, 1)["request"]
        if credit == "reward":
            assert answered < late_asked, "no first-request barrier: session 0 was served before its sibling asked"
        else:
            assert answered >= late_asked, "group RM: session 0 waited at its group's first-request barrier"
    assert all(r["advantage"] is not None for r in rows), "credit still took the whole prompt group"
