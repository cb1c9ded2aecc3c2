"""Fault-injecting fakes for the fault tests (tests/e2e/test_faults.py): an engine that is slow or raises.

`FaultyScriptEngine` is `engine=scripted` (`testing/script_engine.py`) with two knobs read from the
environment at construction, so a test composes it with `engine=scripted
engine._target_=relax_pipeline.testing.faults.FaultyScriptEngine` and no new config keys:

- `FAULTY_ENGINE_DELAY_S`: every generation takes this long (an agent can be killed mid-turn);
- `FAULTY_ENGINE_FAIL_EVERY`: every N-th generation raises `RuntimeError` after yielding to the event loop
  once (the engine failing mid-generation); 0 never;
- `FAULTY_ENGINE_MAX_FAILURES`: stop failing after this many failures (default: no cap), so a test knows
  how many groups at most are dropped whatever order the sessions' calls arrive in.

It is a fake; the runtime never imports it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

from relax_pipeline.engine.base import GenerateResult, ImageFeatures, SamplingParams
from relax_pipeline.testing.script_engine import ScriptEngine


class EngineFault(RuntimeError):
    """The injected engine failure."""


class FaultyScriptEngine(ScriptEngine):
    """The scripted engine, slowed down and failing every N-th generation (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s = float(os.environ.get("FAULTY_ENGINE_DELAY_S", "0"))
        self.fail_every = int(os.environ.get("FAULTY_ENGINE_FAIL_EVERY", "0"))
        self.max_failures = int(os.environ.get("FAULTY_ENGINE_MAX_FAILURES", "-1"))
        self.calls = 0
        self.failures = 0

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Sequence[ImageFeatures] | None = None, session_id: str | None = None) -> GenerateResult:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.fail_every and self.calls % self.fail_every == 0 and self.failures != self.max_failures:
            self.failures += 1
            raise EngineFault(f"injected engine failure (generation {self.calls})")
        return await super().generate(input_ids, sampling, rid, media)
