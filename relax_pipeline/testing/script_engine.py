"""`engine=scripted`: a fake engine that answers from a JSONL script, so a real harness can be driven through
tool calls without a trained model.

`engine.script=PATH` names a JSONL file, one assistant turn a line, in order:
`{"content": "...", "reasoning": "...", "tool_calls": [{"name": "...", "arguments": {...}}],
"finish": "stop" | "length"}`, every field optional. Each line becomes a canonical assistant message that
is rendered through the model's own chat template and tokenizer, so the tokens are the ones the model
would have generated for that turn (its reasoning and tool-call markup included) and the output parser,
the forest, the dump and training all see real tokens. `finish: "length"` ends the turn without the
end-of-turn token, as a turn cut by the length limit. Every session replays the script from its first
line: a request's turn is the number of assistant headers in its prompt (the template's generation
prompt appears once per earlier turn, plus once for this one). Past the script's end the engine answers
a plain "done." turn. Logprobs are a fixed -0.5; weight versions follow `update_weights`. With a
vision-language model folder (`model=tiny_vl`) it loads the model's `Vision` at start, as the hf engine does,
so images (in user and tool messages) are processed, recorded in the forest and dumped; it ignores them.

It is a fake (named so, in `testing/`); the runtime never imports it, the config group builds it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relax_pipeline.canonical.form import Context, Message, ToolCall, canonical_arguments
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.engine.base import GenerateResult, ImageFeatures, SamplingParams
from relax_pipeline.engine.settings import EngineRun, ScriptEngineSettings
from relax_pipeline.engine.vision import Vision
from relax_pipeline.testing.engines import FakeLifecycle

DONE = {"content": "done."}
LOGPROB = -0.5
_LINE_KEYS = {"content", "reasoning", "tool_calls", "finish"}


class ScriptEngine(FakeLifecycle):
    """Replays `script` turn by turn for every session, through the model's template and tokenizer."""

    def __init__(self, settings: ScriptEngineSettings, run: EngineRun) -> None:
        self.model_path = run.model_path
        self.lines = read_script(settings.script)
        self.seed = run.seed
        self.max_context_len = run.max_context_len
        self.max_batch_size = settings.max_batch_size
        self.weight_version = 0
        self.end_of_turn = run.end_of_turn
        self.tokenizer: Any = None
        self.template: ChatTemplate | None = None
        self.vision: Vision | None = None
        """The model's image processor (None for a text-only model); the turn service reads it."""
        self._turns: list[tuple[tuple[int, ...], bool]] = []
        self._header: list[int] = []

    async def start(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.template = ChatTemplate(self.tokenizer, self.end_of_turn)
        self.vision = Vision.load(self.model_path)
        probe = (Message("user", "x"),)
        with_prompt = self.template.prompt_ids(probe, Context())
        without = self.template.encode(self.template.render(probe, Context(), generation_prompt=False))
        self._header = with_prompt[len(without):]
        self._turns = [self._render(line) for line in [*self.lines, DONE]]

    def _render(self, line: dict[str, Any]) -> tuple[tuple[int, ...], bool]:
        """The generated ids of one scripted turn, and whether it ends with the end-of-turn token."""
        assert self.template is not None
        calls = tuple(ToolCall(c["name"], canonical_arguments(c.get("arguments", {}), "arguments"), f"call_{i}")
                      for i, c in enumerate(line.get("tool_calls") or []))
        message = Message("assistant", line.get("content") or "", line.get("reasoning"), calls)
        probe = (Message("user", "x"),)
        before = self.template.prompt_ids(probe, Context())
        text = self.template.render((*probe, message), Context(), generation_prompt=False)
        ids = self.template.encode(text)[len(before):]
        ends = list(self.template.end_of_turn_ids)
        cut = next((i + len(ends) for i in range(len(ids)) if ids[i:i + len(ends)] == ends), len(ids))
        ids = ids[:cut]
        if line.get("finish") == "length":
            return tuple(ids[: len(ids) - len(ends)] if ids[-len(ends):] == ends else ids), False
        return tuple(ids), True

    def turn_of(self, input_ids: Sequence[int]) -> int:
        """Which scripted turn a prompt asks for: its assistant headers, less the generation prompt's."""
        header, ids, count = self._header, list(input_ids), 0
        for i in range(len(ids) - len(header) + 1):
            count += ids[i:i + len(header)] == header
        return max(count - 1, 0)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Sequence[ImageFeatures] | None = None, session_id: str | None = None) -> GenerateResult:
        ids, ended = self._turns[min(self.turn_of(input_ids), len(self._turns) - 1)]
        finish = "stop" if ended else "length"
        if len(ids) > sampling.max_new_tokens:
            ids, finish = ids[: sampling.max_new_tokens], "length"
        stop = ids[-1] if finish == "stop" and ids else None
        return GenerateResult(tuple(ids), (LOGPROB,) * len(ids), finish, self.weight_version, stop)


def read_script(path: str | Path) -> list[dict[str, Any]]:
    """The script's lines, checked: errors name the file, the line and the field."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"engine.script={str(path)!r} is not a file; give a JSONL file, one assistant turn "
                                "a line")
    lines = []
    for number, raw in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        if raw.strip():
            lines.append(_line(_json(raw, f"{file}:{number}"), f"{file}:{number}"))
    return lines


def _json(raw: str, where: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError as error:
        raise ValueError(f"{where}: not valid JSON ({error})") from None


def _line(line: Any, where: str) -> dict[str, Any]:
    if not isinstance(line, dict) or not set(line) <= _LINE_KEYS:
        raise ValueError(f"{where}: a script line is a JSON object with keys among {sorted(_LINE_KEYS)}")
    if line.get("finish", "stop") not in ("stop", "length"):
        raise ValueError(f"{where}: finish must be 'stop' or 'length'")
    for call in line.get("tool_calls") or []:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"{where}: each tool call needs a 'name' and optional 'arguments'")
    return line
