"""Claude Code through the Claude Agent SDK (claude-agent-sdk, which bundles the `claude` CLI), headless,
with its own tools, in the current folder.

Configured only from the environment: Claude Code reads `ANTHROPIC_BASE_URL` and `ANTHROPIC_API_KEY` (set by
the agent contract) and talks Anthropic Messages, always streaming; the model name is `RELAX_MODEL`. The preset
sets `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1` (no api.anthropic.com preflight, no title request: offline)
and `IS_SANDBOX=1` (bypassPermissions is refused to root otherwise). `CLAUDE_CONFIG_DIR` defaults to a fresh
folder per run, so no user settings leak in. The conversation is exported implicitly (no output file).
"""

from __future__ import annotations

import asyncio
import os
import tempfile

from claude_agent_sdk import ClaudeAgentOptions, ResultMessage, query
from common import task_prompt


async def main() -> None:
    config = os.environ.get("CLAUDE_CONFIG_DIR") or tempfile.mkdtemp(prefix="claude-config-")
    options = ClaudeAgentOptions(model=os.environ["RELAX_MODEL"], permission_mode="bypassPermissions",
                                 max_turns=int(os.environ.get("CLAUDE_MAX_TURNS", "8")), cwd=os.getcwd(),
                                 env={"CLAUDE_CONFIG_DIR": config})
    result = None
    async for message in query(prompt=task_prompt(), options=options):
        result = message if isinstance(message, ResultMessage) else result
    if result is None or result.is_error:
        raise SystemExit(f"Claude Code failed: {result.result if result else 'no result message'}")
    print(result.result)


if __name__ == "__main__":
    asyncio.run(main())
