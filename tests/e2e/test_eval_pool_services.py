"""`eval.agent` with its own `services`: the eval pool's agent server is started by the run, like the train pool's.

A `job=eval` run whose train pool runs local agents and whose eval pool (`eval.agent`) sends every session to an
agent server (`executor: http`) that is an `eval.agent.services` entry: the run starts that service before the
first session (`recipes/parts.py`'s `run_services`), health-checked, logs to `<output>/services/<name>.log`,
every eval session reaches it and is scored (the fake edge `relax_pipeline.testing.agent_server` as a process,
answering reward 1.0 after one real model call through the gateway), and the service is stopped at the end. Before
the eval pool's services were started, every eval session failed with an unreachable agent server. A service name
the train pool already uses for another entry is refused, naming both keys.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from test_e2e_rollout import compose_config, read_dump

from relax_pipeline.run import run


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _eval_pool(port: int, name: str = "evalserver") -> list[str]:
    """`eval.agent` keys: executor=http on an agent server that is the pool's own service `name`."""
    command = f"{sys.executable} -m relax_pipeline.testing.agent_server --port {port}"
    service = (f"{{command:'{command}',port:{port},health_url:'http://127.0.0.1:{port}/health',"
               "startup_timeout:60}")
    return ["+eval.agent.executor=http", f"+eval.agent.server_url='http://127.0.0.1:{port}'",
            f"+eval.agent.services={{{name}:{service}}}"]


def test_the_eval_pools_own_service_starts_and_serves_every_eval_session(tmp_path: Path, tiny_path: Path) -> None:
    data = compose_config(tmp_path, tiny_path).dataset.path
    cfg = compose_config(tmp_path, tiny_path, "job=eval", f"eval.datasets=[{{name:toy,path:'{data}'}}]",
                         "runtime.eval_concurrency=2", *_eval_pool(_free_port()))
    metrics = run(cfg)
    log = (tmp_path / "services" / "evalserver.log").read_text()
    rows = [r for p in sorted((tmp_path / "dump").glob("*eval_toy*.jsonl")) for r in read_dump(p)]
    assert rows and all(r["status"] in ("completed", "truncated") and r["reward"] == 1.0 for r in rows), \
        [(r["status"], r.get("error")) for r in rows]
    assert {f"session {r['session_id']} mode eval" for r in rows} <= set(log.splitlines())
    assert metrics["eval/toy/raw_reward"] == 1.0, metrics
    run_log = (tmp_path / "run.log").read_text()
    assert "evalserver" in run_log and "could not reach the agent server" not in run_log


def test_an_eval_service_named_like_a_different_train_service_is_refused(tmp_path: Path, tiny_path: Path) -> None:
    train = f"+agent.services.evalserver={{command:'{sys.executable} -c pass'}}"
    cfg = compose_config(tmp_path, tiny_path, train, *_eval_pool(_free_port()))
    with pytest.raises(ValueError, match="eval.agent.services.evalserver differs from agent.services.evalserver"):
        run(cfg)
