"""The model turn as one service: one model call of one session (`TurnService`), from canonical request to
committed nodes. The sessions it serves live in `sessions.py`.

Turns. Every protocol front-end ends at `TurnService` with a `TurnRequest`. `prepare` (synchronous, the
per-request hot path that `bench/forest.py` measures) attaches the request to the session forest and builds
the prompt ids: a full render for a conversation's first turn, the observation delta for a later one, or
the tokens of an identical observation that is already committed. `run` then generates, parses the output
and commits the observation and response nodes together, so a failed or aborted generation commits
nothing. Requests are token-in, token-out: generated ids are stored as they came and never re-tokenized.

Images: a text-only model refuses any image (`check_media`: a 400 naming its field, before any stream
opens). With a vision-language model (the engine's `vision`) a new message's images are processed once and
belong to its observation node, which keeps the processor-expanded training ids; the engine gets the
lineage's inference ids (one placeholder per image) and images; the context limit counts expanded length.
Not done here: rendering wire responses (the protocol modules) or reading credentials (the gateway).
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from relax_pipeline.canonical.form import CanonicalError, Message
from relax_pipeline.chat.parsers import OutputParser
from relax_pipeline.chat.template import ChatTemplate
from relax_pipeline.engine.base import (
    Engine,
    GenerateResult,
    ImageFeatures,
    SamplingParams,
    expand_placeholders,
    joined,
    resume_input,
)
from relax_pipeline.forest.store import (
    Attachment,
    ForkEvent,
    GenerationPiece,
    Observation,
    SessionForest,
    TurnTiming,
    token_array,
)
from relax_pipeline.turn.errors import LeaseClosed, ProtocolError
from relax_pipeline.turn.records import Lease, SamplingDefaults, TurnRequest, TurnResult
from relax_pipeline.turn.sessions import Session

__all__ = ["HISTORY_POLICIES", "SamplingDefaults", "TurnRequest", "TurnResult", "TurnService", "check_history"]

log = logging.getLogger(__name__)
_RIDS = random.Random(secrets.randbits(64))
"""Engine request ids: unique, not secret, so no system call each; a forked child draws from a fresh seed."""
os.register_at_fork(after_in_child=lambda: _RIDS.seed(secrets.randbits(64)))
HISTORY_POLICIES = ("tokens", "render")
"""`rollout.history`'s values: how a re-sent history is matched against the committed turns."""


def check_history(history: str) -> None:
    """The one check of `rollout.history` (the rollout record and the turn service both call it)."""
    if history not in HISTORY_POLICIES:
        raise ValueError(f"rollout.history={history!r}; choose one of {list(HISTORY_POLICIES)}")


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class PreparedTurn:
    """A request attached to its session's forest with its prompt ids, ready to generate."""

    attachment: Attachment
    observation: Observation
    """The new messages' ids (and images) that `commit` adds below the attach point."""
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    media: tuple[ImageFeatures, ...] = ()
    """Every image of the prompt, in order (for the engine)."""

    @property
    def fork(self) -> ForkEvent | None:
        return self.attachment.match.fork


@dataclass(frozen=True, slots=True)
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
        self._closing: set[asyncio.Task[None]] = set()
        """`close_session` calls in flight (kept referenced until done)."""
        self.parser = parser
        self.defaults = defaults
        self.eval_defaults = eval_defaults or defaults
        """Sampling of eval sessions (`eval.temperature`, `eval.max_response_len`)."""
        check_history(history)
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

    def _prompt(self, at: Attachment) -> tuple[Sequence[int], Sequence[int]]:
        """The observation's ids and the whole prompt: a full render below a root; nothing new on a full match;
        else the delta (or the tokens of an identical committed observation) after the lineage's ids."""
        match = at.match
        if match.parent is None or match.parent.kind == "root":
            obs = self.template.prompt_array(match.delta, match.context)
            return obs, obs
        if match.full:
            return (), at.prompt_ids
        if at.existing is not None:
            obs: Sequence[int] = at.existing.token_ids
        else:
            obs = self.template.delta_array(match.delta, match.context, match.parent.ends_turn)
        at.prompt_ids.extend(obs)  # the attachment's fresh array: extended in place, not copied again
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
        new = at.existing.media if at.existing else tuple(vision.features(i) for m in at.match.delta for i in m.images)
        placeholders = sum(1 for t in obs if t == vision.image_token_id)
        if placeholders != len(new):
            raise CanonicalError(f"the new messages render {placeholders} image placeholder tokens for {len(new)} "
                                 "images; image placeholder tokens may not appear in text", "messages")
        return _TurnMedia(new, at.media + new)

    def _prepared(self, d: SamplingDefaults, at: Attachment, obs: Sequence[int], prompt: Sequence[int],
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
        observation = Observation(token_array(obs), media.new, self._train_ids(obs, media.new))
        return PreparedTurn(at, observation, prompt, sampling, media.lineage)

    async def run(self, forest: SessionForest, request: TurnRequest, rid: str | None = None,
                  seed: int | None = None, session: Session | None = None) -> TurnResult:
        """Generate one turn and commit it; nothing is committed when generation fails or aborts.

        With a `session` whose group holds a `GroupLease`, the generation waits for the lease and is
        resumed after every preemption (partial rollout) until it finishes: one normal answer.
        """
        mode = session.mode if session is not None else "train"
        return await self.run_prepared(forest, self.prepare(forest, request, seed, mode), rid, session)

    def end_session(self, session: Session) -> None:
        """`ForestStore.on_end`: the session ended (completed, failed, dropped, timed out), so the engine may release
        what it keeps for it (engine=sglang closes its SGLang session and frees the KV at once)."""
        try:
            task = asyncio.get_running_loop().create_task(self._close_session(session.id))
        except RuntimeError:  # no loop: nothing runs on the engine any more
            return
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_session(self, session_id: str) -> None:
        try:
            await self.engine.close_session(session_id)
        except Exception as error:  # noqa: BLE001 - releasing KV early is an optimization; the engine evicts later
            log.warning("session %s: the engine could not release its KV: %s", session_id, error)

    async def run_prepared(self, forest: SessionForest, prepared: PreparedTurn, rid: str | None = None,
                           session: Session | None = None) -> TurnResult:
        """`run` for a request already matched by `prepare` (the gateway checks it before a stream opens)."""
        rid = rid or _rid()
        lease = session.lease if session is not None else None
        clock = _TurnClock()
        if lease is None:
            result = await clock.generating(self.engine.generate(prepared.prompt_ids, prepared.sampling, rid,
                                            media=prepared.media, session_id=session.id if session else None))
            clock.first_token(result)
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
                    prompt, sampling = resume_input(prepared.prompt_ids, prepared.sampling, done)
                    more = await clock.generating(self.engine.generate(prompt, sampling, rid, media=prepared.media,
                                                                       session_id=session.id))
                    clock.first_token(more)
            except LeaseClosed as closed:
                raise ProtocolError(404, str(closed)) from None
            done = joined(done, more)
            if more.finish_reason != "abort" or not flight.preempted:
                return done
            done = replace(done, abort_count=aborts + 1)
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
    """Measures one turn: time inside the engine (`generating`, one piece per engine call, with its first token
    when the engine says), the rest until `timing()` is queue. A few clock reads per engine call, no more."""

    def __init__(self) -> None:
        self._wall = time.time()
        self._start = time.perf_counter()
        self._pieces: list[GenerationPiece] = []

    async def generating(self, call: Awaitable[GenerateResult]) -> GenerateResult:
        """Await the engine `call` as one piece (a plain try: no generator per request)."""
        began = time.perf_counter()
        try:
            return await call
        finally:
            ended = time.perf_counter()
            self._pieces.append(GenerationPiece(1000 * (began - self._start), 1000 * (ended - self._start)))

    def first_token(self, result: GenerateResult) -> None:
        """The last piece's first token, from the engine's `first_token_s`."""
        if result.first_token_s is not None and self._pieces:
            piece = self._pieces[-1]
            self._pieces[-1] = replace(piece, first_token_ms=piece.start_ms + 1000 * result.first_token_s)

    def timing(self) -> TurnTiming:
        total = 1000 * (time.perf_counter() - self._start)
        generating = sum(p.end_ms - p.start_ms for p in self._pieces)
        return TurnTiming(total - generating, generating, total, self._wall, tuple(self._pieces))


def _check_last_message(messages: tuple[Message, ...]) -> None:
    if not messages:
        raise CanonicalError("messages must contain at least one message", "messages")
    if messages[-1].role == "assistant":
        raise CanonicalError("the last message must come from user, tool or system; assistant prefill is not "
                             "supported", f"messages[{len(messages) - 1}].role")


def _rid() -> str:
    return f"turn-{_RIDS.getrandbits(64):016x}"
