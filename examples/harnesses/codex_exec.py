"""OpenAI Codex CLI (`codex exec`, the binary of openai-codex-cli-bin) headless on the task, in the current folder.

Configured only from the environment: a fresh `CODEX_HOME` holds a `config.toml` whose model provider points
at `OPENAI_BASE_URL` with the key from `OPENAI_API_KEY` (the agent contract) and the model `RELAX_MODEL`.
Codex speaks only the Responses API, always streaming. The config keeps it offline: `[features] plugins=false`
(no plugin fetch from GitHub or chatgpt.com), analytics off, no update check. `CODEX_SANDBOX` picks the
sandbox for model-run commands (default `danger-full-access`: the session's process group is the boundary).
The conversation is exported implicitly (no output file).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from codex_cli_bin import bundled_codex_path
from common import task_prompt


def config_toml() -> str:
    """The Codex config for one run: our endpoint as the only provider, everything that phones home off."""
    return "\n".join([
        f"model = {json.dumps(os.environ['RELAX_MODEL'])}",
        'model_provider = "relax"',
        "check_for_update_on_startup = false",
        "[model_providers.relax]",
        'name = "relax_pipeline gateway"',
        f"base_url = {json.dumps(os.environ['OPENAI_BASE_URL'])}",
        'wire_api = "responses"',
        'env_key = "OPENAI_API_KEY"',
        "[analytics]",
        "enabled = false",
        "[features]",
        "plugins = false",
        "",
    ])


def main() -> None:
    home = Path(os.environ.get("CODEX_HOME") or tempfile.mkdtemp(prefix="codex-home-"))
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(config_toml(), encoding="utf-8")
    command = [str(bundled_codex_path()), "exec", "--strict-config", "--skip-git-repo-check", "--json",
               "-s", os.environ.get("CODEX_SANDBOX", "danger-full-access"), "-C", os.getcwd(), task_prompt()]
    done = subprocess.run(command, env={**os.environ, "CODEX_HOME": str(home)}, stdin=subprocess.DEVNULL)
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
