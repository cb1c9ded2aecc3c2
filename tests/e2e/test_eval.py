"""Eval runs end to end: two eval datasets with different group sizes next to a multi-context train run,
agents that see RELAX_ROLLOUT_MODE=eval, the advantage function never called for eval groups,
`eval/<name>/...` metrics and eval dump rows, failed eval sessions recorded while the run goes on,
undeclared multi-context sessions failing naming the keys; and how eval sets resolve their group size and
concurrency. Real engine, gateway and subprocess agents (plain HTTP, one model call).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import credit_hooks
import pytest
from hydra import compose, initialize_config_dir

from relax_pipeline.config import CONF_DIR, quote_placeholders, records, register
from relax_pipeline.recipes.parts import capacity_of, eval_sets
from relax_pipeline.run import run

AGENT = '''
import json, os, sys, urllib.request
mode = os.environ["RELAX_ROLLOUT_MODE"]
task = json.load(open(os.environ["RELAX_INPUT_JSON"]))
if task["metadata"].get("fail"):
    print("this eval prompt fails on purpose"); sys.exit(4)
url = os.environ["RELAX_BASE_URL"].rstrip("/") + "/v1/chat/completions"
body = json.dumps({"model": "policy", "messages": task["messages"]}).encode()
headers = {"Content-Type": "application/json", "Authorization": "Bearer " + os.environ["RELAX_API_KEY"]}
reply = json.load(urllib.request.urlopen(urllib.request.Request(url, body, headers)))["choices"][0]["message"]
conversation = task["messages"] + [reply]
meta = {"mode": mode, "outcome": 1.0, "usefulness": 0.5}
records = [{"name": "main", "messages": conversation, "metadata": meta, "reward": 1.0 if mode == "eval" else 0.5}]
if mode == "train":  # training exports a second context; eval only main
    records.append({"name": "searcher", "messages": conversation, "metadata": meta})
with open(os.environ["RELAX_OUTPUT_JSON"], "w") as f:
    f.write("".join(json.dumps(r) + "\\n" for r in records))
'''


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def prompts(n: int, **metadata: object) -> list[dict]:
    return [{"input": f"What is {i} + 1?", "metadata": {"answer": i + 1, **metadata}} for i in range(n)]


def compose_config(tmp_path: Path, *overrides: str):  # noqa: ANN201
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=quote_placeholders([
            f"output_dir={tmp_path}", f"dataset.path={write_jsonl(tmp_path / 'train.jsonl', prompts(2))}",
            "rollout.num_steps=1", "rollout.batch_size=1", "rollout.n_samples_per_prompt=2",
            "rollout.max_response_len=4", f"debug.save_rollout_data={tmp_path}/dump/r_{{rollout_id}}.jsonl",
            *overrides,
        ]))


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_with_two_datasets_next_to_a_multi_context_train_run(tmp_path: Path, tiny_path: Path) -> None:
    (tmp_path / "agent.py").write_text(AGENT)
    alpha = write_jsonl(tmp_path / "alpha.jsonl", prompts(2))
    beta = write_jsonl(tmp_path / "beta.jsonl", prompts(1))
    credit_hooks.CALLS.clear()
    metrics = run(compose_config(
        tmp_path, "job=train", f"model.cache_dir={tiny_path.parent}", f"agent.command='{sys.executable} agent.py'",
        f"agent.cwd={tmp_path}", "agent.multi_context=true", "credit=custom_advantage",
        "credit.advantage_path=credit_hooks.advantage_recording", "credit.log_passrate=true",
        "credit.metrics_path=credit_hooks.metrics_async",
        "trainer.batching.use_dynamic_batch_size=true", "eval.interval=1", "eval.n_samples_per_prompt=3",
        f"eval.datasets=[{{name:alpha,path:{alpha},n_samples_per_prompt:1}},{{name:beta,path:{beta}}}]"))
    assert len(credit_hooks.CALLS) == 1, "one train group, no eval group reaches the advantage function"
    assert [sorted(slot, key=str) for slot in credit_hooks.CALLS[0]] == [["main", "searcher"]] * 2
    assert all(meta["mode"] == "train" for slot in credit_hooks.CALLS[0] for meta in slot.values())
    for done in (0, 1):
        a, b = (read(tmp_path / "dump" / f"r_eval_{name}_{done}.jsonl") for name in ("alpha", "beta"))
        assert [len({r["group_id"] for r in a}), len(a), len({r["group_id"] for r in b}), len(b)] == [2, 2, 1, 3]
        for row in a + b:
            assert (row["mode"], row["metadata"]["mode"], row["name"], row["status"]) == (
                "eval", "eval", "main", "truncated")
    train = read(tmp_path / "dump" / "r_0.jsonl")
    assert sorted(r["name"] for r in train) == ["main", "main", "searcher", "searcher"]
    assert {r["advantage"] for r in train} == {1.0, 0.5}
    assert metrics["rollout/user/rows"] == len(train) and "eval/alpha/user/rows" not in metrics
    for name in ("alpha", "beta"):
        assert metrics[f"eval/{name}/raw_reward"] == 1.0 and metrics[f"eval/{name}/passrate"] == 1.0
        assert f"eval/{name}/num_turns/mean" in metrics and f"eval/{name}/truncated_ratio" in metrics
    assert metrics["train/samples"] == 4
    log = (tmp_path / "run.log").read_text()
    assert log.count("AGENTIC EVAL event=eval_end dataset=beta") == 2


def test_rollout_job_records_failed_eval_sessions_and_undeclared_multi_context_sessions(tmp_path: Path,
                                                                                         tiny_path: Path) -> None:
    """credit=reward without agent.multi_context: eval (one context) works, train sessions exporting two
    contexts end as recorded failures naming the keys, and the run goes on."""
    (tmp_path / "agent.py").write_text(AGENT)
    flaky = write_jsonl(tmp_path / "flaky.jsonl", prompts(1) + prompts(1, fail=True))
    metrics = run(compose_config(
        tmp_path, "job=rollout", f"model.cache_dir={tiny_path.parent}", f"agent.command='{sys.executable} agent.py'",
        f"agent.cwd={tmp_path}", "rollout.n_samples_per_prompt=1", "eval.interval=5", "eval.n_samples_per_prompt=2",
        f"eval.datasets=[{{name:flaky,path:{flaky}}}]"))
    rows = read(tmp_path / "dump" / "r_eval_flaky_0.jsonl")
    assert sorted(r["status"] for r in rows) == ["dropped", "failed", "truncated", "truncated"]
    failed = next(r for r in rows if r["status"] == "failed")
    assert failed["mode"] == "eval" and "exited with code 4" in failed["error"]
    assert metrics["eval/flaky/dropped_groups"] == 1 and metrics["eval/flaky/raw_reward"] == 1.0
    assert not (tmp_path / "dump" / "r_eval_flaky_1.jsonl").exists(), "eval.interval=5: only before the first step"
    train = read(tmp_path / "dump" / "r_0.jsonl")
    assert {r["status"] for r in train} == {"failed"} and metrics["rollout/dropped_groups"] == len(train)
    assert all("exported 2 contexts ['main', 'searcher']; several contexts per session need credit=custom_advantage "
               "and trainer.batching.use_dynamic_batch_size=true" in r["error"] for r in train)


def test_eval_sets_resolve_group_size_and_concurrency(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", prompts(3))
    entries = f"eval.datasets=[{{name:one,path:{data},n_samples_per_prompt:5}},{{name:two,path:{data}}}]"
    base = ("runtime.concurrency=3", "rollout.n_samples_per_prompt=4", entries)
    cfg = compose_config(tmp_path, *base)
    config = records(cfg)
    sets = eval_sets(config, capacity_of(config))
    assert [(s.name, len(s.dataset), s.n_samples, s.concurrency) for s in sets] == [("one", 3, 5, 3), ("two", 3, 1, 12)]
    cfg = compose_config(tmp_path, *base, "runtime.eval_concurrency=2")
    config = records(cfg)
    capped = eval_sets(config, capacity_of(config))
    assert [s.concurrency for s in capped] == [2, 2]
    assert [p.index for p in sets[0].dataset.prompts] == [0, 1, 2]


def test_a_sampling_run_evaluates_greedily(tmp_path: Path) -> None:
    """rollout.temperature=1 samples the train sessions; eval (eval.temperature=0 by default) is greedy, so the
    same prompt evaluated twice with the same weights answers the same tokens, and eval.max_response_len rules."""
    data = write_jsonl(tmp_path / "eval.jsonl", prompts(2))
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    cfg = compose_config(tmp_path, "job=rollout", "rollout.num_steps=2", "rollout.temperature=1.0",
                         "eval.interval=1", "eval.max_response_len=6", f"agent.command='{sys.executable} {agent}'",
                         "agent=minimal", "credit=custom_advantage",
                         "credit.advantage_path=relax_pipeline.credit.examples.outcome_times_usefulness",
                         "trainer.batching.use_dynamic_batch_size=true",
                         f"eval.datasets=[{{name:two,path:{data},n_samples_per_prompt:2}}]")
    run(cfg)
    evals = [read(tmp_path / "dump" / f"r_eval_two_{done}.jsonl") for done in (0, 1, 2)]
    answers = [sorted(tuple(r["tokens"][r["prompt_length"]:]) for r in rows) for rows in evals]
    assert answers[0] == answers[1] == answers[2], "greedy eval answers the same with the same weights"
    assert all(r["response_length"] <= 6 for rows in evals for r in rows)
    for rows in evals:  # the two sessions of one eval prompt answer alike: no sampling
        by_group: dict[str, set] = {}
        for r in rows:
            by_group.setdefault(r["group_id"], set()).add(tuple(r["tokens"][r["prompt_length"]:]))
        assert all(len(answers) == 1 for answers in by_group.values())


def test_eval_sessions_run_on_their_own_agent_pool(tmp_path: Path, tiny_path: Path) -> None:
    """`eval.agent` replaces agent keys for eval sessions only (here the command: an agent that exports reward 0.25
    and the env it sees); the slot table counts the two pools apart and refuses an eval pool with too few slots."""
    one_context = AGENT.replace('if mode == "train":', "if False:")
    (tmp_path / "agent.py").write_text(one_context)
    (tmp_path / "eval_agent.py").write_text(one_context.replace('1.0 if mode == "eval" else 0.5', "0.25"))
    data = write_jsonl(tmp_path / "e.jsonl", prompts(2))
    keys = (f"agent.command='{sys.executable} agent.py'", f"agent.cwd={tmp_path}", "eval.interval=1",
            f"eval.datasets=[{{name:own,path:{data}}}]", f"+eval.agent.command='{sys.executable} eval_agent.py'",
            "+eval.agent.slots=2", f"model.cache_dir={tiny_path.parent}")
    metrics = run(compose_config(tmp_path, "job=rollout", *keys))
    assert metrics["eval/own/raw_reward"] == 0.25 and metrics["rollout/raw_reward"] == 0.5
    for sub in ("check", "few", "typo"):
        (tmp_path / sub).mkdir()
    checked = compose_config(tmp_path / "check", "job=check", *keys)
    run(checked)
    log = (tmp_path / "check" / "run.log").read_text()
    assert "train pool: required slots = T = 2; eval pool (eval.agent): required slots = E_peak = 2" in log
    too_few = compose_config(tmp_path / "few", "job=check", *keys[:-2], "+eval.agent.slots=1",
                             f"model.cache_dir={tiny_path.parent}")
    with pytest.raises(ValueError, match=r"eval.agent.slots=1 is too few: eval needs 2 agent slots"):
        run(too_few)
    with pytest.raises(ValueError, match=r"eval.agent.comand is not an agent key"):
        run(compose_config(tmp_path / "typo", "job=check", *keys[:4], "+eval.agent.comand=x",
                           f"model.cache_dir={tiny_path.parent}"))
