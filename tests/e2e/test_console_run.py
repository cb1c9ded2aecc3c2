"""The console of a real run (`python -m relax_pipeline`, the tiny model, 2 training steps, an eval before the first
and after each, one metric added to the headline on the command line): stderr, as a terminal shows it, has one
headline line per step and one per eval, no progress-bar fragment inside any line, and none of the per-step detail
lines; run.log still has every full line design §3.4 documents (`step N metrics k=v ...`, the accounting and
eval-end lines)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from relax_pipeline.testing.terminal import screen

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "toy_digits" / "data.jsonl"
BAR = re.compile(r"\d+%\||\d+/\d+ \[|scored/s|s/ scored")
"""A fragment of a tqdm bar (`62%|`, `40/64 [`, `17.67 scored/s`)."""


def test_one_headline_per_step_no_bar_inside_a_line_and_run_log_keeps_the_full_lines(tmp_path: Path,
                                                                                     tiny_path: Path) -> None:
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(DIGITS.read_text().splitlines(True)[:2]))
    done = subprocess.run([
        sys.executable, "-m", "relax_pipeline", "rollout.num_steps=2", "rollout.batch_size=2",
        "rollout.n_samples_per_prompt=4", "rollout.max_response_len=8", f"output_dir={tmp_path}/run",
        f"model.cache_dir={tiny_path.parent}", "eval.interval=1", "eval.n_samples_per_prompt=2",
        f"eval.datasets=[{{name:heldout,path:{heldout}}}]", f"hydra.run.dir={tmp_path}/hydra",
        "tracking.console_metrics=[reward:rollout/raw_reward,eval:eval/*/raw_reward,loss:train/loss,train/samples]"],
        capture_output=True, timeout=600, cwd=tmp_path)
    stderr = done.stderr.decode()  # not text=True: universal newlines would turn the bars' carriage returns into lines
    assert done.returncode == 0, stderr[-3000:]
    assert BAR.search(stderr), "the progress bars were drawn (stderr is a pipe: tqdm still draws)"
    shown = screen(stderr)
    headlines = [line for line in shown if line.startswith("step ") and " · " in line]
    assert [h.split(" · ")[0] for h in headlines] == ["step 1/2", "step 2/2"], shown
    figure = r"[-\d.e+]+"
    chosen = rf" · reward {figure} · eval heldout {figure} · loss {figure} · samples 8 · [\d.]+ s/step"
    assert all(re.search(chosen, h) for h in headlines), headlines
    assert "· eta " in headlines[0] and "· eta " not in headlines[1]
    assert [line.split(" · ")[0] for line in shown if line.startswith("eval after ")] == [
        "eval after 0 steps", "eval after 1 step", "eval after 2 steps"]
    assert not [line for line in shown if BAR.search(line)], "a bar fragment left on a line of the screen"
    for raw in stderr.split("\n"):
        last = raw.split("\r")[-1]  # what the line ends with once the bar is cleared
        assert not (BAR.search(last) and (" INFO " in last or " · " in last)), raw
    assert not [line for line in shown if " metrics " in line or "AGENTIC " in line], "detail lines stay in run.log"
    log = (tmp_path / "run" / "run.log").read_text()
    for n in (0, 1):
        assert re.search(rf"INFO relax_pipeline: step {n} metrics \S+=\S+ .*rollout/raw_reward=\S+ .*train/loss=", log)
        assert f"AGENTIC ROLLOUT event=accounting_end rollout={n} " in log
    assert re.search(r"INFO relax_pipeline: eval after 2 steps metrics \S+=\S+ .*eval/heldout/raw_reward=", log)
    assert log.count("AGENTIC EVAL event=eval_end dataset=heldout") == 3 and " · " not in log
