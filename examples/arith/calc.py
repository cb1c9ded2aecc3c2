"""The calculator environment of `agent=arith_calc`: the tool, the parser of the model's tool use, the episode.

The protocol is plain text in the model's own chat template (no `tools` field: SmolLM2-135M never writes a
well-formed hermes `<tool_call>` unprompted, 0 of 30 problems, while it does write a `calc` line). A reply
whose first line starts with `calc` is a tool call: `calc 12 * 34` (two integers and `+`, `-` or `*`, parsed
by hand, never evaluated as code). The environment answers it in a user turn, `calculator: 408`, or, for a
call it cannot parse, `calculator: error: ...` naming the accepted form (a malformed call). Any other reply
is the final answer: its last integer is checked against the problem's answer (reward 1.0 or 0.0). A
session that is still calling the tool after `max_turns` replies ends with reward 0 (`too_many_turns`).

`episode` runs one session against any `ask(messages) -> reply` function, so the agent process and the unit
tests share it. What it does not do: talk HTTP (the agent does), or choose the prompt (`instruction`,
`example` and `control` below are the agent's, kept here so the tests and the agent agree).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

INSTRUCTION = ("You have a calculator: write calc a op b (two numbers, op is +, - or *) and it replies with the "
               "value. Then give the answer.")
"""No concrete numbers: SmolLM2-135M copies an example's numbers into its own call (`calc 12 * 34` on every
problem, 0 of 200 validation problems right, when the instruction said "for example calc 12 * 34")."""
CHAIN_INSTRUCTION = ("You have a calculator: write calc a op b (two numbers, op is +, - or *) and it replies with "
                     "the value. One operation a call. Then give the answer.")
"""The instruction for chained problems (`ARITH_INSTRUCTION=chain`): `INSTRUCTION` and that a call does one
operation; still no concrete numbers and no worked chain. (A longer "call it again with its value for the next
one" made the base model write bare expressions without `calc`.)"""
ONE_AT_A_TIME = ("calculator: error: one operation a call: calc the first two numbers, then call again with its "
                 "value and the next number")
"""The reply, with `one_at_a_time`, to a call that holds several operations (`calc 47 * 86 + 12`): how the tool
is used, in general words; no numbers, no step of this problem."""
FIRST_OPERATION = "calculator: error: one operation a call; this call's first one is calc {first}"
"""The reply, with `name_first`, to a call of several operations: the first operation of the model's own call
(`calc 47 * 86 + 12` → `calc 47 * 86`), read off what it wrote, not off the problem."""
_SEVERAL = re.compile(r"[\s()]*-?\d+(?:[\s()]*[+\-*x×][\s()]*-?\d+){2,}[\s()=.]*")
_FIRST = re.compile(r"[\s()]*(-?\d+)[\s()]*([+\-*x×])[\s()]*(-?\d+)")
INSTRUCTIONS = {"one": INSTRUCTION, "chain": CHAIN_INSTRUCTION}
"""`ARITH_INSTRUCTION`'s choices."""
CONTROL = "Answer with just the number."
"""The single-shot control's instruction: the same problem, no calculator."""
_CALL = re.compile(r"calc\b:?(.*)", re.IGNORECASE)
_EXPRESSION = re.compile(r"\s*(-?\d+)\s*([+\-*x×])\s*(-?\d+)\s*=?\s*\.?\s*")
_INTEGER = re.compile(r"-?\d+")
MALFORMED = "calculator: error: write calc, two numbers and +, - or *, for example calc 12 * 34"


@dataclass
class Outcome:
    """What one session did: its reward and the figures the eval reports (agent output metadata)."""

    reward: float = 0.0
    turns: int = 0
    """Model replies."""
    calls: int = 0
    """Well-formed calculator calls."""
    malformed: int = 0
    """Calls the calculator could not parse."""
    too_many_turns: bool = False
    operands: list[tuple[int, int]] = field(default_factory=list)
    """The two numbers of each well-formed call, in order."""
    values: list[int] = field(default_factory=list)
    """The calculator's value for each well-formed call, in order."""

    def chained(self) -> bool:
        """The second well-formed call takes the first call's value as one of its numbers."""
        return len(self.values) >= 2 and self.values[0] in self.operands[1]

    def linked(self) -> bool:
        """Every well-formed call after the first takes the value of the call before it (no stale value)."""
        return len(self.values) >= 2 and all(value in numbers for value, numbers in
                                             zip(self.values, self.operands[1:], strict=False))

    def metadata(self, tools: bool, steps: int | None = None) -> dict[str, float]:
        """Numeric metadata for the rollout and eval metrics (`eval/<name>/used_tool/mean`, ...). A problem
        needing `steps` calls adds `solved_<steps>` and `calls_<steps>` (each averages over those problems
        alone: success and calls by calls needed); one needing two or more adds `solved_multi` and
        `chained`/`linked` (the share whose second call used the first call's value / whose every call used
        the value before it)."""
        figures = {"used_tool": float(self.calls > 0), "turns": float(self.turns), "calls": float(self.calls),
                   "malformed": float(self.malformed), "too_many_turns": float(self.too_many_turns),
                   "tools": float(tools)}
        if steps is not None:
            figures.update({f"solved_{steps}": self.reward, f"calls_{steps}": float(self.calls)})
        if steps is not None and steps >= 2:
            figures.update(solved_multi=self.reward, chained=float(self.chained()), linked=float(self.linked()))
        return figures


def parse(expression: str) -> tuple[int, str, int] | None:
    """`a op b` as its two integers and operation (`x` and `×` read as `*`), or None when it is not of that form."""
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        return None
    op = match.group(2)
    return int(match.group(1)), "*" if op in "x×" else op, int(match.group(3))


def calculate(expression: str) -> int | None:
    """The value of `a op b` (two integers; `x` and `×` multiply), or None when it is not of that form."""
    parsed = parse(expression)
    if parsed is None:
        return None
    a, op, b = parsed
    return a + b if op == "+" else a - b if op == "-" else a * b


def tool_call(reply: str) -> str | None:
    """The expression of a calculator call (the reply's first line starts with `calc`), else None."""
    lines = reply.strip().splitlines()
    match = _CALL.match(lines[0].strip()) if lines else None
    return match.group(1) if match else None


@dataclass(frozen=True)
class Replies:
    """How the calculator words its replies: the chain setting's options (all off: `agent=arith_calc`'s)."""

    one_at_a_time: bool = False
    """A call of several operations gets `ONE_AT_A_TIME` instead of `MALFORMED`."""
    name_first: bool = False
    """... or `FIRST_OPERATION`, naming the first operation of that call."""
    echo: bool = False
    """A value comes back with its call: `calculator: 47 * 86 = 4042`."""


PLAIN = Replies()
"""`agent=arith_calc`'s replies."""


def respond(expression: str, replies: Replies = PLAIN) -> tuple[str, bool]:
    """The calculator's answer to a call, and whether the call was well-formed."""
    parsed, value = parse(expression), calculate(expression)
    if parsed is not None and value is not None:
        a, op, b = parsed
        return (f"calculator: {a} {op} {b} = {value}" if replies.echo else f"calculator: {value}"), True
    if not _SEVERAL.fullmatch(expression) or not (replies.one_at_a_time or replies.name_first):
        return MALFORMED, False
    if replies.name_first:
        first = _FIRST.match(expression)
        assert first is not None
        op = "*" if first.group(2) in "x×" else first.group(2)
        return FIRST_OPERATION.format(first=f"{first.group(1)} {op} {first.group(3)}"), False
    return ONE_AT_A_TIME, False


def made_calls(numbers: list[int], ops: list[str], given: int, replies: Replies = PLAIN) -> list[dict]:
    """The first `given` calls of the chain `numbers`/`ops` as the environment makes them with its own
    calculator: a `calc` line and its reply each (what `metadata.given` asks the agent to show as prompt)."""
    messages, value = [], numbers[0]
    for op, number in zip(ops[:given], numbers[1:given + 1], strict=True):
        call = f" {value} {op} {number}"
        text, _ = respond(call, replies)
        messages += [{"role": "assistant", "content": f"calc{call}"}, {"role": "user", "content": text}]
        value = calculate(call)  # type: ignore[assignment]
    return messages


def final_answer(reply: str) -> int | None:
    """The last integer of a final reply (thousands separators allowed), or None."""
    numbers = _INTEGER.findall(reply.replace(",", ""))
    return int(numbers[-1]) if numbers else None


def episode(ask: Callable[[list[dict]], str], messages: list[dict], answer: int, max_turns: int,
            tools: bool = True, replies: Replies = PLAIN) -> Outcome:
    """Run one session: ask, answer each calculator call, stop at the first final reply or after `max_turns`
    replies. `messages` grows with the conversation. Without `tools` the first reply is final (the control);
    `replies` words the calculator's replies (`Replies`)."""
    outcome = Outcome()
    for _ in range(max_turns if tools else 1):
        reply = ask(messages)
        messages.append({"role": "assistant", "content": reply})
        outcome.turns += 1
        expression = tool_call(reply) if tools else None
        if expression is None:
            outcome.reward = float(final_answer(reply) == answer)
            return outcome
        text, well_formed = respond(expression, replies)
        outcome.calls += well_formed
        outcome.malformed += not well_formed
        if well_formed:
            a, _, b = parse(expression)  # type: ignore[misc]
            outcome.operands.append((a, b))
            outcome.values.append(calculate(expression))  # type: ignore[arg-type]
        messages.append({"role": "user", "content": text})
    outcome.too_many_turns = True
    return outcome
