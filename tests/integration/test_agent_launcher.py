"""The agent launcher and session files: real `bash` subprocesses, real files, no mocks.

Timeouts and grace periods stay at or under two seconds so the module runs in a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest

from relax_pipeline.agent.launcher import ActiveTimer, AgentExit, AgentFailure, AgentProcess, AgentSpec
from relax_pipeline.agent.session_io import (
    AgentOutput,
    AgentOutputError,
    build_input,
    parse_output,
    write_input,
)
from relax_pipeline.forest.export import ExportRecord

SESSION_ENV_KEYS = ("RELAX_INPUT_JSON", "RELAX_OUTPUT_JSON", "RELAX_SESSION_IO_DIR", "RELAX_BASE_URL",
                    "RELAX_SESSION_ID", "RELAX_ROLLOUT_MODE", "RELAX_GROUP_ID")


def session_env(io_dir: Path) -> dict[str, str]:
    """The nine RELAX_* variables a session passes."""
    return {
        "RELAX_INPUT_JSON": str(io_dir / "input.json"),
        "RELAX_OUTPUT_JSON": str(io_dir / "output.json"),
        "RELAX_SESSION_IO_DIR": str(io_dir),
        "RELAX_BASE_URL": "http://127.0.0.1:9/agentic_api/",
        "RELAX_SESSION_ID": "s-1",
        "RELAX_API_KEY": "s-1",
        "RELAX_MODEL": "relax",
        "RELAX_ROLLOUT_MODE": "train",
        "RELAX_GROUP_ID": "g-1",
    }


async def run_agent(tmp_path: Path, command: str, **spec_kwargs: object) -> tuple[AgentProcess, AgentExit]:
    """Start `command`, wait for it and return the process and its exit."""
    proc = AgentProcess(AgentSpec(command=command, **spec_kwargs))  # type: ignore[arg-type]
    await proc.start(session_env(tmp_path), tmp_path)
    return proc, await proc.wait()


def process_gone(pid: int, within_s: float = 2.0) -> bool:
    """True once `pid` no longer exists or is a zombie (this sandbox's init may not reap orphans)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if _is_zombie(pid):
            return True
        time.sleep(0.02)
    return False


def _is_zombie(pid: int) -> bool:
    """Whether /proc shows `pid` as a zombie (or gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


# ---------------------------------------------------------------- launcher


@pytest.mark.asyncio
async def test_environment_arrives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARENT_VAR", "from-parent")
    monkeypatch.setenv("RELAX_STALE", "leaked")
    command = 'env > "$RELAX_SESSION_IO_DIR/env.txt"'
    _, done = await run_agent(tmp_path, command, env={"USER_VAR": "ü-value"})
    assert done.exit_code == 0 and done.active_s >= 0 and done.elapsed_s >= 0
    lines = (tmp_path / "env.txt").read_text(encoding="utf-8").splitlines()
    seen = dict(line.split("=", 1) for line in lines if "=" in line)
    for key, value in session_env(tmp_path).items():
        assert seen[key] == value
    assert seen["USER_VAR"] == "ü-value" and seen["PARENT_VAR"] == "from-parent"
    assert "RELAX_STALE" not in seen


@pytest.mark.asyncio
async def test_harness_variables_point_at_the_gateway_unless_agent_env_sets_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "a-real-key-from-the-parent")
    command = 'env > "$RELAX_SESSION_IO_DIR/env.txt"'
    await run_agent(tmp_path, command, env={"ANTHROPIC_BASE_URL": "http://mine/"})
    seen = dict(line.split("=", 1) for line in (tmp_path / "env.txt").read_text().splitlines() if "=" in line)
    assert seen["OPENAI_BASE_URL"] == "http://127.0.0.1:9/agentic_api/v1"
    assert seen["OPENAI_API_KEY"] == seen["ANTHROPIC_API_KEY"] == "s-1"
    assert seen["ANTHROPIC_BASE_URL"] == "http://mine/"
    assert seen["RELAX_MODEL"] == "relax"


def test_reserved_prefix_rejected_in_spec_env() -> None:
    with pytest.raises(ValueError, match="the RELAX_ prefix is reserved"):
        AgentSpec(command="true", env={"RELAX_BASE_URL": "http://elsewhere/"})


@pytest.mark.asyncio
async def test_session_env_must_use_prefix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="agent.env"):
        await AgentProcess(AgentSpec(command="true")).start({"OTHER": "x"}, tmp_path)


@pytest.mark.asyncio
async def test_cwd_honoured_and_stdin_is_devnull(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    command = 'pwd > "$RELAX_SESSION_IO_DIR/pwd.txt"; cat > "$RELAX_SESSION_IO_DIR/stdin.txt"'
    await run_agent(tmp_path, command, cwd=str(work))
    assert Path((tmp_path / "pwd.txt").read_text().strip()).resolve() == work.resolve()
    assert (tmp_path / "stdin.txt").read_text() == ""


@pytest.mark.asyncio
async def test_agent_nice_lowers_the_priority_of_the_agents_session(tmp_path: Path) -> None:
    """agent.nice: the agent's session (its autogroup, where the kernel has them) and main process run at lower
    priority; a child it forks inherits the process's nice."""
    command = ('sleep 0.3; cd "$RELAX_SESSION_IO_DIR"; cat /proc/self/autogroup > group.txt 2>/dev/null; '
               "ps -o ni= -p $$ > main.txt; sh -c 'ps -o ni= -p $$' > child.txt")
    await run_agent(tmp_path, command, nice=7)
    assert (tmp_path / "main.txt").read_text().strip() == "7" and (tmp_path / "child.txt").read_text().strip() == "7"
    if Path("/proc/sys/kernel/sched_autogroup_enabled").is_file():
        assert (tmp_path / "group.txt").read_text().strip().endswith("nice 7")
    with pytest.raises(ValueError, match="agent.nice=20: use an integer from 0 to 19"):
        AgentSpec(command="true", nice=20)


@pytest.mark.asyncio
async def test_missing_cwd_is_an_agent_failure(tmp_path: Path) -> None:
    with pytest.raises(AgentFailure, match="agent.cwd"):
        await run_agent(tmp_path, "true", cwd=str(tmp_path / "nope"))


@pytest.mark.asyncio
async def test_timeout_kills_grandchild(tmp_path: Path) -> None:
    command = 'sleep 60 & echo $! > "$RELAX_SESSION_IO_DIR/child.pid"; echo started; sleep 60'
    with pytest.raises(AgentFailure) as caught:
        await run_agent(tmp_path, command, timeout=0.5, grace_s=1.0)
    assert caught.value.exit_code is None
    assert caught.value.reason == "timed out after 0.5 s of active time"
    assert "started" in caught.value.log_tail
    assert process_gone(int((tmp_path / "child.pid").read_text()))


@pytest.mark.asyncio
async def test_stray_child_killed_after_normal_exit(tmp_path: Path) -> None:
    command = 'sleep 60 & echo $! > "$RELAX_SESSION_IO_DIR/child.pid"; exit 0'
    _, done = await run_agent(tmp_path, command, grace_s=1.0)
    assert done.exit_code == 0
    assert process_gone(int((tmp_path / "child.pid").read_text()))


@pytest.mark.asyncio
async def test_crash_carries_exit_code_and_last_output(tmp_path: Path) -> None:
    command = 'echo "first line"; echo "Traceback: boom at the end" >&2; exit 3'
    with pytest.raises(AgentFailure) as caught:
        await run_agent(tmp_path, command)
    failure = caught.value
    assert failure.exit_code == 3 and failure.reason == "exited with code 3"
    assert "exited with code 3" in str(failure) and "Traceback: boom at the end" in str(failure)
    assert "first line" in (tmp_path / "agent.log").read_text()


@pytest.mark.asyncio
async def test_death_by_signal_is_named(tmp_path: Path) -> None:
    with pytest.raises(AgentFailure) as caught:
        await run_agent(tmp_path, "kill -KILL $$")
    assert caught.value.reason == "killed by signal SIGKILL" and caught.value.exit_code is None


@pytest.mark.asyncio
async def test_log_tail_is_bounded(tmp_path: Path) -> None:
    command = "for i in $(seq 1 500); do echo line-$i; done; echo tail-end; exit 1"
    with pytest.raises(AgentFailure) as caught:
        await run_agent(tmp_path, command, log_tail_bytes=32)
    assert len(caught.value.log_tail.encode()) <= 32 and caught.value.log_tail.endswith("tail-end\n")


@pytest.mark.asyncio
async def test_paused_timer_does_not_expire(tmp_path: Path) -> None:
    proc = AgentProcess(AgentSpec(command="sleep 0.8; echo done", timeout=0.3, grace_s=0.2))
    await proc.start(session_env(tmp_path), tmp_path)
    proc.timer.pause()
    done = await proc.wait()
    assert done.exit_code == 0 and done.active_s < 0.3 <= done.elapsed_s


@pytest.mark.asyncio
async def test_resumed_timer_expires(tmp_path: Path) -> None:
    proc = AgentProcess(AgentSpec(command="sleep 60", timeout=0.3, grace_s=0.5))
    await proc.start(session_env(tmp_path), tmp_path)
    proc.timer.pause()
    waiting = asyncio.create_task(proc.wait())
    await asyncio.sleep(0.5)
    assert not waiting.done()
    proc.timer.resume()
    with pytest.raises(AgentFailure, match="timed out after 0.3 s of active time"):
        await waiting


@pytest.mark.asyncio
async def test_sigterm_ignoring_agent_is_killed_after_grace(tmp_path: Path) -> None:
    command = "trap '' TERM; echo ready; sleep 60; sleep 60"
    proc = AgentProcess(AgentSpec(command=command, timeout=0.3, grace_s=0.3))
    await proc.start(session_env(tmp_path), tmp_path)
    with pytest.raises(AgentFailure, match="timed out"):
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL
    await proc.terminate()  # a second call, after exit, is harmless


@pytest.mark.asyncio
async def test_cancelled_wait_terminates_group(tmp_path: Path) -> None:
    proc = AgentProcess(AgentSpec(command="sleep 60", grace_s=1.0))
    await proc.start(session_env(tmp_path), tmp_path)
    waiting = asyncio.create_task(proc.wait())
    await asyncio.sleep(0.1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert proc.returncode is not None


def test_active_timer_counts_only_running_time() -> None:
    now = [100.0]
    timer = ActiveTimer(10.0, clock=lambda: now[0])
    timer.start()
    now[0] += 4
    timer.pause()
    now[0] += 50
    assert timer.elapsed() == 4 and timer.remaining() == 6 and not timer.expired
    timer.resume()
    now[0] += 6
    assert timer.expired and timer.remaining() == 0
    assert ActiveTimer(None).remaining() == float("inf")


# ---------------------------------------------------------------- session input


def test_build_input_string_and_messages(tmp_path: Path) -> None:
    assert build_input("hi", None) == {"messages": [{"role": "user", "content": "hi"}]}
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert build_input(messages, {"k": 1}) == {"messages": messages, "metadata": {"k": 1}}
    assert build_input(None, {"k": 1}) == {"metadata": {"k": 1}}
    assert build_input(None, None) == {}
    with pytest.raises(TypeError):
        build_input(42, None)  # type: ignore[arg-type]
    write_input(tmp_path / "in.json", build_input("héllo", None))
    assert "héllo" in (tmp_path / "in.json").read_text(encoding="utf-8")


# ---------------------------------------------------------------- session output


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "output.json"
    path.write_text(text, encoding="utf-8")
    return path


MSGS = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]


@pytest.mark.parametrize("text", [None, "", "  \n\t\n"])
def test_absent_or_empty_output_is_implicit(tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "output.json" if text is None else write(tmp_path, text)
    assert parse_output(path) == AgentOutput(implicit=True, records=(), reward=None, metadata={})


@pytest.mark.parametrize("reward", [1.5, {"correct": 1, "format": 0.5}, None])
def test_object_without_messages_is_implicit_with_reward(tmp_path: Path, reward: object) -> None:
    out = parse_output(write(tmp_path, json.dumps({"reward": reward, "metadata": {"t": 1}})))
    assert out == AgentOutput(implicit=True, records=(), reward=reward, metadata={"t": 1})


def test_object_with_messages_is_one_explicit_record(tmp_path: Path) -> None:
    obj = {"messages": MSGS, "reward": 1, "tools": [{"type": "function"}], "chat_template_kwargs": {"x": 1}}
    out = parse_output(write(tmp_path, json.dumps(obj, indent=2)))
    record = ExportRecord(name="main", messages=MSGS, tools=[{"type": "function"}],
                          chat_template_kwargs={"x": 1}, metadata={}, reward=1)
    assert out == AgentOutput(implicit=False, records=(record,), reward=None, metadata={})
    named = parse_output(write(tmp_path, json.dumps({"name": "solver", "messages": MSGS})))
    assert named.records[0].name == "solver"


def test_jsonl_gives_one_record_per_line(tmp_path: Path) -> None:
    lines = [{"name": "a", "messages": MSGS, "reward": 0.5}, {"name": "b", "messages": MSGS[:1],
                                                               "metadata": {"m": 2}}]
    out = parse_output(write(tmp_path, "\n".join(json.dumps(line) for line in lines) + "\n\n"))
    assert not out.implicit and [r.name for r in out.records] == ["a", "b"]
    assert out.records[0].reward == 0.5 and out.records[1].reward is None
    assert out.records[1].metadata == {"m": 2} and out.records[0].tools is None


def test_json_array_is_rejected_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(AgentOutputError, match="write JSONL, not a JSON array"):
        parse_output(write(tmp_path, json.dumps([{"name": "a", "messages": MSGS}])))


def test_malformed_jsonl_names_file_and_line(tmp_path: Path) -> None:
    good = json.dumps({"name": "a", "messages": MSGS})
    path = write(tmp_path, f"{good}\n\n{{\"name\": \"b\", oops}}\n")
    with pytest.raises(AgentOutputError, match=r"output\.json: line 3: invalid JSON") as caught:
        parse_output(path)
    assert str(path) in str(caught.value)


def test_malformed_pretty_object_names_its_line(tmp_path: Path) -> None:
    with pytest.raises(AgentOutputError, match="line 3: invalid JSON"):
        parse_output(write(tmp_path, '{\n  "reward": 1,\n  "metadata": {,}\n}\n'))


def test_duplicate_names_are_rejected(tmp_path: Path) -> None:
    text = "\n".join(json.dumps({"name": n, "messages": MSGS}) for n in ("a", "b", "a"))
    with pytest.raises(AgentOutputError, match=r"line 3: duplicate record name 'a' \(first on line 1\)"):
        parse_output(write(tmp_path, text))


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ({"messages": MSGS}, '"name" must be a non-empty string'),
        ({"name": "", "messages": MSGS}, '"name" must be a non-empty string'),
        ({"name": "a", "messages": []}, '"messages" must be a non-empty list'),
        ({"name": "a", "messages": MSGS, "tools": {}}, '"tools" must be a list'),
        ({"name": "a", "messages": MSGS, "message": 1}, "unknown key"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_bad_jsonl_records_are_rejected(tmp_path: Path, line: object, fragment: str) -> None:
    first = json.dumps({"name": "ok", "messages": MSGS})
    with pytest.raises(AgentOutputError, match="line 2") as caught:
        parse_output(write(tmp_path, f"{first}\n{json.dumps(line)}\n"))
    assert fragment in str(caught.value)


def test_typo_in_implicit_object_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(AgentOutputError, match="unknown key.*'message'"):
        parse_output(write(tmp_path, json.dumps({"message": MSGS, "reward": 1})))


def test_non_object_document_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(AgentOutputError, match="must be a JSON object"):
        parse_output(write(tmp_path, "1.0"))
