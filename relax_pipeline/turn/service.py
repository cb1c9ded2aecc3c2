"""The turn service: one model call of one session, from canonical request to committed nodes.

Every protocol front-end ends here with a `TurnRequest`. `prepare` (synchronous, the per-request hot
path that `bench/forest.py` measures) matches the request in the session forest and builds the prompt
ids: a full render for a conversation's first turn, the observation delta for a later one, or the
tokens of an identical observation that is already committed. `run` then generates, parses the output
and commits the observation and response nodes together, so a failed or aborted generation commits
nothing. Requests are token-in, token-out: generated ids are stored as they came and never re-tokenized.

Images: a text-only model refuses any image (`check_media`, a 400 naming the image's field, before any
stream opens). For a vision-language model (the engine's `vision`), the images of the new messages are
processed once and belong to the observation node that brought them; the engine gets the lineage's
inference ids (one placeholder per image) with every image of the lineage, the observation node also
keeps its processor-expanded training ids, and the context limit counts the expanded length.

This module does not render wire responses (the protocol modules do) and does not authenticate.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from relax_pipeline.canonical.form import CanonicalError, Message
from relax_pipeline.engine.base import (
    Engine,
    GenerateResult,
    ImageFeatures,
    SamplingParams,
    derive_seed,
    expand_placeholders,
    varying,
)
from relax_pipeline.engine.parsers import OutputParser
from relax_pipeline.engine.template import ChatTemplate
from relax_pipeline.forest.store import Attachment, ForkEvent, Observation, SessionForest, TurnTiming
from relax_pipeline.turn.errors import ProtocolError
from relax_pipeline.turn.leases import LeaseClosed
from relax_pipeline.turn.records import SamplingDefaults, TurnRequest, TurnResult
from relax_pipeline.turn.sessions import Lease, Session

__all__ = ["HISTORY_POLICIES", "SamplingDefaults", "TurnRequest", "TurnResult", "TurnService"]

log = logging.getLogger(__name__)
HISTORY_POLICIES = ("tokens", "render")


@dataclass(frozen=True)
class PreparedTurn:
    """A request attached to its session's forest with its prompt ids, ready to generate."""

    attachment: Attachment
    observation: Observation
    """The new messages' ids (and images) that `commit` adds below the attach point."""
    prompt_ids: list[int]
    sampling: SamplingParams
    media: tuple[ImageFeatures, ...] = ()
    """Every image of the prompt, in order (for the engine)."""

    @property
    def fork(self) -> ForkEvent | None:
        return self.attachment.match.fork


@dataclass(frozen=True)
class _TurnMedia:
    new: tuple[ImageFeatures, ...] = ()
    lineage: tuple[ImageFeatures, ...] = ()

    @property
    def extra_tokens(self) -> int:
        """How much longer the expanded prompt is than the inference ids."""
        return sum(m.tokens - 1 for m in self.lineage)


_NO_MEDIA = _TurnMedia()


class TurnService:
    """Matches, tokenizes, generates, parses and commits turns for all sessions."""

    def __init__(self, template: ChatTemplate, engine: Engine, parser: OutputParser, defaults: SamplingDefaults,
                 history: str = "tokens", eval_defaults: SamplingDefaults | None = None) -> None:
        self.template = template
        self.engine = engine
        self.parser = parser
        self.defaults = defaults
        self.eval_defaults = eval_defaults or defaults
        """Sampling of eval sessions (`eval.temperature`, `eval.max_response_len`)."""
        if history not in HISTORY_POLICIES:
            raise ValueError(f"rollout.history={history!r}; choose one of {list(HISTORY_POLICIES)}")
        self.reuse_visible = history == "tokens"
        """`rollout.history=tokens`: a re-sent assistant turn equal in what is visible reuses its tokens."""
        if template.vision is None:
            template.vision = engine.vision
        eos = template.tokenizer.eos_token_id
        ids = set(template.end_of_turn_ids) | ({eos} if isinstance(eos, int) else set())
        self.stop_token_ids = tuple(sorted(ids))

    def prepare(self, forest: SessionForest, request: TurnRequest, seed: int | None = None,
                mode: str = "train") -> PreparedTurn:
        """Match the request and build its prompt ids (no generation, no commit).

        `seed` is the session's seed for this turn, used when the request brings none; `mode` "eval" samples
        with the eval defaults (`eval.temperature`, greedy by default, and `eval.max_response_len`).
        """
        d = self.eval_defaults if mode == "eval" else self.defaults
        _check_last_message(request.messages)
        at = forest.attach(request.context, request.messages, request.hashes, self.reuse_visible,
                           media=self.template.vision is not None)
        # committed messages hold no image (a text-only model refused them), so only the new ones are checked
        self.template.check_media(at.match.delta, len(request.messages) - len(at.match.delta))
        obs, prompt = self._prompt(at)
        return self._prepared(d, at, obs, prompt, request, request.seed if request.seed is not None else seed)

    def _prompt(self, at: Attachment) -> tuple[Sequence[int], list[int]]:
        """The observation's ids and the whole prompt: a full render below a root; nothing new on a full match;
        else the delta (or the tokens of an identical committed observation) after the lineage's ids."""
        match = at.match
        if match.parent is None or match.parent.kind == "root":
            obs = self.template.prompt_ids(match.delta, match.context)
            return obs, obs
        if match.full:
            return (), at.prompt_ids
        if at.existing is not None:
            obs: Sequence[int] = at.existing.token_ids
        else:
            obs = self.template.delta_ids(match.delta, match.context, match.parent.ends_turn)
        at.prompt_ids.extend(obs)  # the attachment's fresh list: extended in place, not copied again
        return obs, at.prompt_ids

    def check_media(self, request: TurnRequest) -> None:
        """Refuse images when the model is text-only (400 naming the first image's field)."""
        self.template.check_media(request.messages)

    def _media(self, at: Attachment, obs: Sequence[int]) -> _TurnMedia:
        """The images of the new observation and of the whole prompt (nothing for text-only models)."""
        vision = self.template.vision
        if vision is None:
            return _NO_MEDIA
        if not obs:
            return _TurnMedia((), at.media)
        existing = at.existing
        new = existing.media if existing else tuple(vision.features(i) for m in at.match.delta for i in m.images)
        placeholders = sum(1 for t in obs if t == vision.image_token_id)
        if placeholders != len(new):
            raise CanonicalError(f"the new messages render {placeholders} image placeholder tokens for {len(new)} "
                                 "images; image placeholder tokens may not appear in text", "messages")
        return _TurnMedia(new, at.media + new)

    def _prepared(self, d: SamplingDefaults, at: Attachment, obs: Sequence[int], prompt: list[int],
                  request: TurnRequest, seed: int | None) -> PreparedTurn:
        media = self._media(at, obs)
        length = len(prompt) + media.extra_tokens
        room = d.max_context_len - length
        if room <= 0:
            raise ProtocolError(
                400,
                f"prompt is too long: {length} tokens > {d.max_context_len} maximum (the context limit, "
                "rollout.max_context_len); shorten the history",
                "messages",
                "context_length_exceeded",
            )
        limit = min(request.max_tokens or d.max_response_len, d.max_response_len, room)
        sampling = SamplingParams(limit, d.temperature, d.top_p, d.top_k, request.stop, self.stop_token_ids, seed)
        observation = Observation(tuple(obs), media.new, self._train_ids(obs, media.new))
        return PreparedTurn(at, observation, prompt, sampling, media.lineage)

    async def run(self, forest: SessionForest, request: TurnRequest, rid: str | None = None,
                  seed: int | None = None, session: Session | None = None) -> TurnResult:
        """Generate one turn and commit it; nothing is committed when generation fails or aborts.

        With a `session` whose group holds a `GroupLease`, the generation waits for the lease and is
        resumed after every preemption (partial rollout) until it finishes: one normal answer.
        """
        mode = session.mode if session is not None else "train"
        return await self.run_prepared(forest, self.prepare(forest, request, seed, mode), rid, session)

    async def run_prepared(self, forest: SessionForest, prepared: PreparedTurn, rid: str | None = None,
                           session: Session | None = None) -> TurnResult:
        """`run` for a request already matched by `prepare` (the gateway checks it before a stream opens)."""
        rid = rid or _rid()
        lease = session.lease if session is not None else None
        clock = _TurnClock()
        if lease is None:
            with clock.generating():
                result = await self.engine.generate(prepared.prompt_ids, prepared.sampling, rid, media=prepared.media)
        else:
            result = await self._leased(prepared, rid, session, lease, clock)
        if result.finish_reason == "abort":
            raise ProtocolError(499, "generation was aborted before it finished; nothing was committed")
        turn = self.commit(forest, prepared, result, clock.timing())
        if prepared.fork is not None:
            log.info("session %s turn %d forked: %s", session.id if session else "-", forest.turn_count,
                     prepared.fork.describe())
        return turn

    async def _leased(self, prepared: PreparedTurn, rid: str, session: Session, lease: Lease,
                      clock: _TurnClock) -> GenerateResult:
        """Generate under the lease; a preempted generation resumes with its partial tokens appended."""
        done: GenerateResult | None = None
        while True:
            aborts = done.abort_count if done else 0
            try:
                async with lease.generation(session, rid, aborts) as flight:
                    with clock.generating():
                        more = await self.engine.generate(*_resume_input(prepared, done), rid, media=prepared.media)
            except LeaseClosed as closed:
                raise ProtocolError(404, str(closed)) from None
            done = joined(done, more)
            if more.finish_reason != "abort" or not flight.preempted:
                return done
            done = dataclasses.replace(done, abort_count=aborts + 1)
            lease.count_abort(session)

    def commit(self, forest: SessionForest, prepared: PreparedTurn, result: GenerateResult,
               timing: TurnTiming | None = None) -> TurnResult:
        message, ends_turn = self._parse(result, prepared.attachment.match.context.tools)
        node = forest.commit(prepared.attachment, prepared.observation, message, result, prepared.sampling,
                             ends_turn, timing)
        finish = "length" if result.finish_reason == "length" else "tool_calls" if message.tool_calls else "stop"
        return TurnResult(message, finish, len(prepared.prompt_ids), result, node.id)

    def _train_ids(self, obs: Sequence[int], new_media: tuple[ImageFeatures, ...]) -> tuple[int, ...]:
        """The observation's processor-expanded ids; empty when it has no images (same as inference ids)."""
        if not new_media or self.template.vision is None:
            return ()
        return tuple(expand_placeholders(obs, self.template.vision.image_token_id, new_media))

    def _parse(self, result: GenerateResult, tools: Sequence[Mapping[str, Any]] = ()) -> tuple[Message, bool]:
        ids = list(result.output_ids)
        ends_turn = bool(ids) and ids[-1] in self.template.end_of_turn_ids
        if ids and ids[-1] in self.stop_token_ids:
            ids = ids[:-1]
        text = self.template.decode(ids)
        if isinstance(result.matched_stop, str) and result.matched_stop in text:
            text = text[: text.index(result.matched_stop)]
        parsed = self.parser.parse(text, tools=tools)
        return Message("assistant", parsed.content, parsed.reasoning, parsed.tool_calls), ends_turn


class _TurnClock:
    """Measures one turn: time inside the engine (`generating`), the rest until `timing()` is queue."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._generating = 0.0

    @contextmanager
    def generating(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self._generating += time.perf_counter() - began

    def timing(self) -> TurnTiming:
        total = time.perf_counter() - self._start
        return TurnTiming(1000 * (total - self._generating), 1000 * self._generating, 1000 * total)


def _resume_input(prepared: PreparedTurn, done: GenerateResult | None) -> tuple[list[int], SamplingParams]:
    """Prompt and sampling of the next piece: partial tokens appended (and given as the stop strings' context),
    the remaining token budget."""
    if done is None:
        return prepared.prompt_ids, prepared.sampling
    sampling = prepared.sampling
    seed = None if sampling.seed is None else derive_seed(sampling.seed, len(done.output_ids))
    left = max(sampling.max_new_tokens - len(done.output_ids), 1)
    return prepared.prompt_ids + list(done.output_ids), dataclasses.replace(
        sampling, max_new_tokens=left, seed=seed, stop_context=tuple(done.output_ids))


def joined(first: GenerateResult | None, more: GenerateResult) -> GenerateResult:
    """One result from a preempted generation and its continuation; every token keeps its version."""
    if first is None:
        return more
    return GenerateResult(first.output_ids + more.output_ids, first.logprobs + more.logprobs, more.finish_reason,
                          more.weight_version, more.matched_stop, varying(first.token_versions + more.token_versions),
                          first.abort_count)


def _check_last_message(messages: tuple[Message, ...]) -> None:
    if not messages:
        raise CanonicalError("messages must contain at least one message", "messages")
    if messages[-1].role == "assistant":
        raise CanonicalError(
            "the last message must come from user, tool or system; assistant prefill is not supported",
            f"messages[{len(messages) - 1}].role",
        )


def _rid() -> str:
    return "turn-" + secrets.token_hex(8)
