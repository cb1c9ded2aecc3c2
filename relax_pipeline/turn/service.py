"""The model turn as one service: the sessions of a run (`ForestStore`) and one model call of one session
(`TurnService`), from canonical request to committed nodes.

Sessions. A session is one agent process working on one copy of a prompt. Its life is a small state machine
designed for every runtime mode, of which `sync` uses the first and the terminal states:

    created ─► waiting ─► running ─► exited ─► completed | truncated
       │          │   ▲       │  │                 (samples exported)
       │          │   └parked◄┘  └──────────────► failed | dropped | filtered | aborted
       └──────────┴─────────────────────────────► dropped

`waiting`: the process runs but its group holds no runtime lease yet (prelaunch holds first requests
here); `parked`: between steps under partial/fully-async modes. The gateway serves requests only in
`waiting`/`running`/`parked` states and answers 404 in terminal ones. Every session ends in exactly one
terminal state with a reason, so nothing is lost silently. `ForestStore` is the typed registry every stage
and the gateway share; sessions change only through it, and it does no I/O.

Credentials (docs/design.md §4, invariant 7): a session id (`sess-`, not secret) and a separate key (`rk-`,
never logged); `authenticate` finds a session by its key, and by its id only with `session_ids=True` (a
loopback gateway). `release` forgets an ended session once its group's rows are written (the pipeline does it at the
end of each step), keeping only its key, id and final status, so a run of days holds the sessions of its
live groups, not every forest it ever recorded.

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
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, TypeVar

from relax_pipeline.canonical.form import CanonicalError, Message
from relax_pipeline.canonical.memo import RequestMemo
from relax_pipeline.engine.base import (
    Engine,
    GenerateResult,
    ImageFeatures,
    SamplingParams,
    derive_seed,
    expand_placeholders,
    joined,
    resume_input,
)
from relax_pipeline.engine.parsers import OutputParser
from relax_pipeline.engine.template import ChatTemplate
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

__all__ = ["HISTORY_POLICIES", "ForestStore", "Lease", "SamplingDefaults", "Session", "Status", "TurnRequest",
           "TurnResult", "TurnService", "derive_seed"]

log = logging.getLogger(__name__)
_RIDS = random.Random(secrets.randbits(64))
"""Engine request ids: unique, not secret, so no system call each; a forked child draws from a fresh seed."""
os.register_at_fork(after_in_child=lambda: _RIDS.seed(secrets.randbits(64)))
HISTORY_POLICIES = ("tokens", "render")
T = TypeVar("T")


class Status(StrEnum):
    CREATED = "created"
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"
    EXITED = "exited"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"
    DROPPED = "dropped"
    FILTERED = "filtered"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def serving(self) -> bool:
        return self in (Status.WAITING, Status.RUNNING, Status.PARKED)


_TERMINAL = frozenset(
    {Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED, Status.DROPPED, Status.FILTERED}
)


@dataclass
class Session:
    """One agent run on one prompt copy; owned by the ForestStore, mutated only through it."""

    id: str
    group_id: str
    index: int
    rollout_id: int
    mode: str
    prompt: dict[str, Any]
    status: Status = Status.CREATED
    error: str | None = None
    forest: SessionForest = field(default_factory=SessionForest)
    memo: RequestMemo = field(default_factory=RequestMemo)
    timing: dict[str, float] = field(default_factory=dict)
    abort_count: int = 0
    in_flight: int = 0
    seed: int = 0
    """Base of the sampling seeds of this session's turns (requests without their own seed)."""
    lease: Lease | None = None
    """The group's lease (barrier, hold, preemption); None serves requests at once (tests, eval)."""
    responses: dict[str, int] = field(default_factory=dict)
    """Response id → the response node it committed (so a request may continue from it by id)."""
    key: str = field(default_factory=lambda: "rk-" + secrets.token_urlsafe(24), repr=False)
    """The session's secret credential (`RELAX_API_KEY`); random, independent of `id`, never logged."""

    def mark(self, event: str) -> None:
        self.timing[event] = time.time()

    def turn_seed(self) -> int:
        """The sampling seed of this session's next turn: reproducible from the run seed and the turn."""
        return derive_seed(self.seed, self.forest.turn_count)


class ForestStore:
    """All sessions of a run by id; the gateway authenticates against it."""

    def __init__(self, on_end: Callable[[Session], None] | None = None) -> None:
        self.on_end = on_end
        """Called once when a session reaches a terminal status (the turn service releases the engine's KV)."""
        self._sessions: dict[str, Session] = {}
        self._keys: dict[str, Session] = {}
        self._released: dict[str, tuple[str, Status]] = {}
        """Key → (id, final status) of released sessions: enough to answer their late requests with a 404."""
        self._released_ids: dict[str, tuple[str, Status]] = {}
        """The same by session id, for a loopback gateway where the id is a credential too."""

    def open(self, group_id: str, index: int, rollout_id: int, mode: str, prompt: dict[str, Any],
             seed: int = 0) -> Session:
        """A new session with a random id (its key); `seed` is the base of its turns' sampling seeds."""
        session = Session("sess-" + secrets.token_hex(12), group_id, index, rollout_id, mode, prompt, seed=seed)
        session.mark("created")
        self._sessions[session.id] = session
        self._keys[session.key] = session
        return session

    def get(self, session_id: str) -> Session | None:
        """The session named `session_id` (not a credential: see `authenticate`)."""
        return self._sessions.get(session_id)

    def authenticate(self, credential: str, session_ids: bool = False) -> Session | None:
        """The session whose secret key is `credential`; with `session_ids` (a loopback gateway) also the
        session whose id it is. None for anything else (a session id too, unless `session_ids`)."""
        session = self._keys.get(credential)
        if session is None and session_ids:
            session = self._sessions.get(credential)
        return session

    def released(self, credential: str, session_ids: bool = False) -> tuple[str, Status] | None:
        """(id, final status) of the released session whose key is `credential` (or, with `session_ids`, whose
        id it is); None for anything else."""
        found = self._released.get(credential)
        if found is None and session_ids:
            found = self._released_ids.get(credential)
        return found

    def release(self, session: Session) -> bool:
        """Forget an ended session whose rows are written (its forest, memo and prompt go with it); its key
        keeps answering 404. A session still live is kept; returns whether `session` was released."""
        if not session.status.terminal:
            return False
        self._sessions.pop(session.id, None)
        self._keys.pop(session.key, None)
        self._released[session.key] = self._released_ids[session.id] = (session.id, session.status)
        return True

    def set_status(self, session: Session, status: Status, error: str | None = None) -> None:
        """Move a session to `status`; a terminal state is final and keeps its first reason."""
        if session.status.terminal:
            return
        session.status = status
        if error is not None:
            session.error = error
        session.mark(status.value)
        if status.terminal and self.on_end is not None:
            self.on_end(session)

    def attach_lease(self, session: Session, lease: Lease) -> None:
        """From now on `session`'s requests wait on its group's `lease`."""
        session.lease = lease

    def count_abort(self, session: Session) -> None:
        session.abort_count += 1

    def remember_response(self, session: Session, response_id: str, node_id: int) -> None:
        """`response_id` (as the client saw it) names the response node `node_id` of `session`."""
        session.responses[response_id] = node_id

    def response_history(self, session: Session, response_id: str) -> tuple[Message, ...] | None:
        """The conversation up to and including the response `response_id` of `session`; None if unknown."""
        node_id = session.responses.get(response_id)
        if node_id is None:
            return None
        return session.forest.history(node_id)

    async def serving(self, session: Session, work: Awaitable[T]) -> T:
        """Await `work` with a request of `session` counted in flight (a plain try: no generator per request)."""
        session.in_flight += 1
        try:
            return await work
        finally:
            session.in_flight -= 1

    def __iter__(self) -> Iterator[Session]:
        return iter(self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)


# --- the turn service ---------------------------------------------------------------------------


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
