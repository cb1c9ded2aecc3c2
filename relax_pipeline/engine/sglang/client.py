"""`engine=sglang`: the `Engine` protocol as a client of SGLang's native HTTP API (token in, token out).

API followed: SGLang `SGLANG_API_VERSION` (0.5.23, the registry's newest release when this was written; smg 1.13.0
in front): its `sglang/srt/entrypoints/http_server.py` (routes), `sglang/srt/managers/io_struct.py` (request
bodies), `sglang/api/v1/api_types.py` (the `/generate` JSON contract) and `managers/tokenizer_manager.py` (the
answers' `meta_info`). `tests/integration/test_sglang_conformance.py` reads them from that release's wheel and fails
when this client calls a route, sends a field or reads an answer field the release lacks. Routes used, and nothing
else (`relax_pipeline.testing.sglang_server` implements exactly these):

- `GET /health`, `GET /model_info` (`is_generation`), `GET /server_info` (`version`, `max_total_num_tokens`,
  `tp_size`, `enable_session_radix_cache`) once per server at start; an error names the URL and what to check.
- `POST /generate` with `input_ids` (never text), `sampling_params` (`max_new_tokens`, `temperature`,
  `top_p`, `top_k`, `stop`, `stop_token_ids`, `sampling_seed`, `no_stop_trim`, `skip_special_tokens`),
  `return_logprob=true`, `logprob_start_len=-1`, `stream=false`, our `rid`, `cache_salt` (the loaded weight
  version's cache namespace, below), and `session_params` for a turn of an SGLang session. Tokens and logprobs
  come from `meta_info.output_token_logprobs` (`[logprob, token_id, text]` per token; `output_ids` must agree),
  the finish from `meta_info.finish_reason` (`stop` with `matched`, `length`, `abort`), the version from
  `meta_info.weight_version` (and `weight_versions` spans), `prompt_tokens` and `cached_tokens`.
- `POST /abort_request {"rid"}` for partial rollout: the pending `/generate` then answers with the tokens
  and logprobs generated so far and finish `abort`; `abort` returns that result (the turn service resumes
  with prompt + partial tokens and the remaining budget). The abort is repeated every second until the
  generation answers (a request still on its way is not yet known to the server).
- `GET /metrics` (SGLang's Prometheus mount, `--enable-metrics`) for program admission's load.
- After a training step, on every server (`engine.weight_transfer`, `sglang/weights.py`): `disk` (the default)
  sends `POST /update_weights_from_disk {"model_path", "weight_version", "flush_cache"}`, the weights written as a
  loadable Hugging Face folder (`<weights_dir>/v<version>`, model files copied from `model.path`) on storage the
  servers can read (the previous folder is removed); `tensor` sends the tensors themselves, in buckets, as
  `POST /update_weights_from_tensor {"serialized_named_tensors", "flush_cache", "weight_version"}`;
  `distributed` broadcasts them in a process group with the servers (`POST /init_weights_update_group` once,
  `POST /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name", "flush_cache",
  "weight_version"}` per bucket, `POST /destroy_weights_update_group` at close). Tensor and distributed loads run
  inside `POST /begin_weight_update` ... `POST /end_weight_update` (0.5.23 refuses them outside).

Fresh KV after every update, in every mode: SGLang flushes its radix cache after a load only when the load's
`flush_cache` is true, and refuses that flush (failing the load) while requests run or wait
(`scheduler_components/weight_updater.py`). So every `/generate` carries `cache_salt` = the loaded weight version
(`wire.cache_salt`): SGLang matches a prefix only within its salt (`mem_cache/radix_cache.py`), and a request sent
after a load never reuses KV older weights computed, whatever the mode. With `engine.weight_update=abort` (the
default) the runtime aborted every generation first, and the load also flushes (`flush_cache=true`), freeing the old
cache at once. With `pause` the load is wrapped in `POST /pause_generation {"mode": "in_place"}` and `POST
/continue_generation` and sent with `flush_cache=false` (a flush would fail while the paused requests hold their
KV): running generations keep their own KV and go on with the new weights, each token keeping the version that
sampled it (`meta_info.weight_versions`); requests sent before the load finished (running, queued at the server, or
on their way) are in flight through the update like them. The new salt applies from the moment the load succeeded;
the old salt's entries are evicted as ordinary unused cache. `in_flight_updates` tells the runtime it need not
abort first.

Servers: `engine.urls=[...]` connects to running servers; `engine.launch=true` starts `engine.servers`
servers (`sglang/launch.py`, logs in `<output>/sglang/`) and stops them at `close`; with `engine.placement=ray`
(the default when `ray.address` is set) they are placed on a Ray cluster, one placement-group bundle per server
(`sglang/placement.py`). `engine.router=smg` puts smg in front (`sglang/smg.py`; started, or `engine.router_url`
when one runs): generations go through it with the routing key of `sglang.routing.Affinity` as
`x-smg-routing-key` (its `manual` policy keeps a key on one worker); pause, continue, the weight-update session
and disk or tensor loads fan out through its RL control plane; aborts, sessions and the distributed group go to
the servers directly. Without a router, the client routes itself (`WorkerPool`, same keys).

Sessions (`engine.sessions=true`, the default): a `generate` that names its agent session (`session_id=`) is a
turn of one SGLang session (`POST /open_session {capacity_of_str_len, session_id, timeout}` at its first turn,
`session_params {id, rid, offset}` on each turn, so the request carries only the new tokens and the server
rebuilds the rest from the session's own nodes; `sglang/sessions.py`); `close_session(session_id)`
(`POST /close_session`) ends it when the agent session ends, fails, is dropped or times out
(`engine.session_timeout_s` bounds a session nobody closes). Whether the session's KV is held is the server's
`--enable-session-radix-cache`: with it, the session's KV is referenced while it is open (eviction takes
unreferenced KV first) and `/close_session` only dereferences it (it stays cached, evictable like any); without
it the session's KV is ordinary LRU cache. Launched servers get the flag; running ones must report it in
`/server_info`, else the start is refused (or, with `engine.sessions_fallback=true`, the engine runs without
sessions, said once). Without `session_id`, or with `engine.sessions=false`, every turn is a plain request.
KV-aware admission: per request (`engine.admission=kv`) in `sglang.routing.KvAdmission`, per agent session
(`program`) in `program_admission.py`.

Stop strings: SGLang matches them in a request's own output, so for a resumed generation (`stop_context`, the
output before the abort) `stopped_across` cuts the result after a stop string split by the abort.

Images (a vision-language model): `vision` is `sglang.media.SglangVision`, the model's own image processor (the
turn service makes the forest's `ImageFeatures` with it, as on engine=hf, so the training input is the same),
and a prompt with images goes as `image_data` (their URLs, in order) with its unexpanded placeholder tokens,
which SGLang expands itself; context limits count the expanded length. SGLang re-tokenizes image prompts, so a
served length other than ours is counted (`engine/image_token_mismatches`) or, with
`engine.image_mismatch=refuse`, fails the turn. Such a turn is a plain request, never a session turn (SGLang's
session nodes hold expanded ids, which this client does not mirror).

Not supported: streaming, LoRA, video and audio.
"""


from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson

from relax_pipeline.engine.base import AdapterWeights, GenerateResult, ImageFeatures, SamplingParams
from relax_pipeline.engine.program_admission import ProgramAdmission, sglang_load
from relax_pipeline.engine.settings import EngineRun, SessionsPart, SglangEngineSettings
from relax_pipeline.engine.sglang.launch import Processes, launch_servers, router_command, workers_healthy
from relax_pipeline.engine.sglang.media import SglangVision, expanded_length
from relax_pipeline.engine.sglang.placement import RayServers
from relax_pipeline.engine.sglang.routing import ROUTING_KEY_HEADER, Affinity, KvAdmission, WorkerLoad, WorkerPool
from relax_pipeline.engine.sglang.sessions import OpenSession, Sessions
from relax_pipeline.engine.sglang.smg import RlControl, check_installed
from relax_pipeline.engine.sglang.weights import DistributedWeights, check_transfer, tensor_bodies, write_weights
from relax_pipeline.engine.sglang.wire import SglangError, cache_salt, parse_generate, payload, stopped_across
from relax_pipeline.infra.ports import free_port

log = logging.getLogger(__name__)
SGLANG_API_VERSION = "0.5.23"
"""The SGLang release whose HTTP API this client (and the fake server) follows."""


@dataclass
class _Flight:
    """One generation in flight: where it went and how it ended (what `abort` waits for)."""

    worker: WorkerLoad
    answered: asyncio.Future[GenerateResult | None]
    """Set once `generate` ends: its result, or None when it failed or was cancelled."""
    wire: str
    """The rid sent to SGLang (ours, suffixed when a session holds a node of that rid already)."""
    aborted: bool = False
    admission: asyncio.Task[None] | None = None


@dataclass
class _Targets:
    """The servers and the entry point of generations (the router, or None for client-side routing)."""

    urls: list[str] = field(default_factory=list)
    router: str | None = None


class SglangEngine:
    """Client of SGLang servers (see the module); one instance per run."""

    def __init__(self, settings: SglangEngineSettings, run: EngineRun) -> None:
        self.settings = settings
        """The `engine` node (engine/settings.py); its keys were checked when it was made."""
        self.model_path, self.seed, self.max_context_len = run.model_path, run.seed, run.max_context_len
        self.max_batch_size = settings.max_batch_size
        self.weight_version = 0
        self.vision: SglangVision | None = None
        """The model's image processing (`sglang/media.py`; set by `start`); None for text-only models."""
        self.urls = [u.rstrip("/") for u in settings.urls]
        router = settings.router_part
        self.router_url = router.url if router is not None else None
        base = Path(run.output_dir) / "sglang" if run.output_dir else Path(tempfile.gettempdir()) / "relax-sglang"
        self.log_dir = Path(settings.log_dir) if settings.log_dir else base
        self.weights_dir = Path(settings.weights_dir) if settings.weights_dir else base / "weights"
        self.affinity = Affinity(settings.affinity_block)
        admission = settings.admission_part
        self.admission = KvAdmission(admission.headroom, admission.max_wait_s) if admission is not None else None
        self.programs = ProgramAdmission.built(settings.program_part, lambda: self.weight_version)
        self.processes = Processes(self.log_dir)
        placement = settings.placement_part(run.ray)
        self.placement = "ray" if placement is not None else "local"
        """`engine.placement`, resolved (null: ray when launching with a `ray.address`)."""
        self.ray_servers = RayServers(self.log_dir, run.ray, placement.strategy, placement.cpus_per_server) \
            if placement is not None else None
        """engine.placement=ray: the servers placed on the Ray cluster (`sglang/placement.py`)."""
        self.server_info: dict[str, dict[str, Any]] = {}
        """`/server_info` of every server, by URL (read at start)."""
        self._targets = _Targets()
        self._pool: WorkerPool | None = None
        self._shared: WorkerLoad | None = None
        self._flights: dict[str, _Flight] = {}
        self._background: set[asyncio.Task[None]] = set()
        """Aborts sent for cancelled generations (kept referenced until done)."""
        self.sessions: Sessions | None = None
        """engine.sessions=true: the open SGLang sessions, by agent session id (set at start)."""
        self._http: httpx.AsyncClient | None = None
        self._tokenizer: Any = None
        self._written: Path | None = None
        self.cache_version = 0
        """The weight version whose cache namespace (`cache_salt`) new requests use: set once a load succeeded."""
        self._rl: RlControl | None = None
        """engine.router=smg with its RL control plane: pause, continue and loads fan out through it."""
        self.weights = settings.weights_part
        """engine.weight_update, weight_transfer, weight_backend, weight_master_address."""
        self.distributed = DistributedWeights(partial(self._call, "POST"), self.weights.backend,
                                              self.weights.master_address) \
            if self.weights.transfer == "distributed" else None
        """engine.weight_transfer=distributed: rank 0 of the weight-update group with the servers."""

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of `model_path` (the gateway renders and parses with it; the servers never see text)."""
        if self._tokenizer is None:
            raise RuntimeError("SglangEngine has no tokenizer: call `await engine.start()` first")
        return self._tokenizer

    async def start(self) -> None:
        """Load the tokenizer, launch or reach the servers (and the router), check each one."""
        if self._http is not None:
            return
        from transformers import AutoTokenizer

        check_transfer(self.weights.transfer, self.weights.backend)
        self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.model_path)
        if (Path(self.model_path) / "config.json").is_file():
            self.vision = await asyncio.to_thread(SglangVision.load, self.model_path)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0),
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        try:
            urls = await self._launch_servers() if self.settings.launch else list(self.urls)
            workers = [await WorkerLoad.checked(self._call, url, self.server_info) for url in urls]
            router = await self._start_router(urls) if self.settings.router == "smg" else None
            self._targets = _Targets(urls, router)
            if router is not None:
                self._rl = await RlControl.connect(self._call, router, urls)
            sessions = self._sessions_supported(urls, self.settings.sessions_part)
        except BaseException:
            await self.close()
            raise
        if self._targets.router is None:
            self._pool = WorkerPool(workers)
        else:
            self._shared = WorkerLoad(self._targets.router, sum(w.capacity for w in workers))
        if self.programs is not None:
            self.programs.watch(sum(w.capacity for w in workers), sglang_load(self._call, self._targets.urls))
        if sessions is not None:
            self.sessions = Sessions(self._call, self.max_context_len, sessions.timeout_s,
                                     self._tokenizer.bos_token_id)

    async def generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                       media: Sequence[ImageFeatures] | None = None, session_id: str | None = None) -> GenerateResult:
        """POST /generate (token ids in and out) to the worker of this prompt's routing key; with `session_id`
        (engine.sessions=true) as a turn of that agent session's SGLang session (see the module)."""
        call = lambda: self._generate(input_ids, sampling, rid, media, session_id)  # noqa: E731
        return await (call() if self.programs is None else self.programs.generate(call, input_ids, sampling, rid,
                                                                                  session_id))

    async def _generate(self, input_ids: Sequence[int], sampling: SamplingParams, rid: str,
                        media: Sequence[ImageFeatures] | None, session_id: str | None) -> GenerateResult:
        prompt, images = self._prompt(input_ids, media), self._images(input_ids, media)
        length = expanded_length(prompt, media or ())
        limit = min(sampling.max_new_tokens, self.max_context_len - length)
        if limit <= 0:
            return GenerateResult((), (), "length", self.weight_version)
        if rid in self._flights:
            raise ValueError(f"rid {rid!r} is already generating")
        key = self.affinity.key_for(prompt)
        worker = self._pool.pick(key) if self._pool is not None else self._shared
        assert worker is not None
        session = await self._session(session_id, worker, key) if not images else None
        if session is not None:
            worker, key = session.worker, session.key
        flight = _Flight(worker, asyncio.get_running_loop().create_future(),
                         session.tree.wire_rid(rid) if session is not None else rid)
        self._flights[rid] = flight
        try:
            result = await self._sent(flight, prompt, sampling, (limit, length + limit), key, session, images)
            flight.answered.set_result(result)
        except asyncio.CancelledError:
            if not flight.aborted:  # the caller gave up: stop the server's work too
                task = asyncio.get_running_loop().create_task(self._send_abort(flight.wire, worker))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            raise
        finally:
            self._flights.pop(rid, None)
            if not flight.answered.done():
                flight.answered.set_result(None)  # failed or cancelled: an abort waiting on it gets None
        if result.finish_reason != "abort":
            self.affinity.finished(prompt, result.output_ids, key)
        return stopped_across(self.tokenizer, sampling, result)

    async def close_session(self, session_id: str) -> None:
        """Release the SGLang session of agent session `session_id` (its KV); nothing when it has none. The turn
        service calls it when the agent session ends, fails, is dropped or times out."""
        if self.programs is not None:
            self.programs.end(session_id)
        if self.sessions is not None and self._http is not None:
            await self.sessions.close(session_id)

    async def abort(self, rid: str) -> GenerateResult | None:
        """Abort `rid`; its partial result (finish "abort"), or None when it is unknown or finished first."""
        flight = self._flights.get(rid)
        if flight is None:
            return self.programs.abort(rid) if self.programs is not None else None
        flight.aborted = True
        if flight.admission is not None and not flight.admission.done():
            flight.admission.cancel()
        for _ in range(120):
            if not flight.answered.done():
                await self._send_abort(flight.wire, flight.worker)
            done, _ = await asyncio.wait([flight.answered], timeout=1.0)
            if done:
                break
        result = flight.answered.result() if flight.answered.done() else None
        return result if result is not None and result.finish_reason == "abort" else None

    @property
    def in_flight_updates(self) -> bool:
        """engine.weight_update=pause: running generations go on through `update_weights` (paused, not aborted), so
        the runtime need not abort them first."""
        return self.weights.update == "pause"

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Load `state_dict` on every server as `version` (engine.weight_transfer: from a folder written as
        `<weights_dir>/v<version>`, or as tensors), paused around the load with engine.weight_update=pause; requests
        sent after the load use the new version's cache namespace (`cache_salt`, see the module)."""
        folder = None
        if self.weights.transfer == "disk":
            folder = self.weights_dir / f"v{version}"
            await asyncio.to_thread(write_weights, state_dict, Path(self.model_path), folder)
        if not self.in_flight_updates:  # the runtime aborted every generation: the servers are idle, flush
            await self._load(state_dict, version, folder, True)
            self.cache_version = version
        else:  # in place: running requests keep their KV; a flush would fail while they run (weight_updater.py)
            await self._control("/pause_generation", {"mode": "in_place"})
            try:
                await self._load(state_dict, version, folder, False)
                self.cache_version = version
            finally:
                await self._control("/continue_generation", {})
        self.weight_version = version
        previous, self._written = self._written, folder or self._written
        if previous is not None and previous != self._written:
            await asyncio.to_thread(shutil.rmtree, previous, True)

    async def update_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Not served: this client loads no LoRA adapters on SGLang servers yet."""
        raise ValueError(f"engine=sglang does not serve LoRA adapters yet (adapter {adapter.name!r}): train with "
                         "trainer.lora on engine=hf, or without trainer.lora on engine=sglang")

    def step_metrics(self) -> dict[str, float]:
        """Metrics since the last call (`engine/kv_reserved`, `engine/admission_wait_s`, `engine/sessions_open`,
        ..., `engine/image_token_mismatches` for a vision model); the step loop logs them with each step. Empty
        without admission, sessions and images."""
        metrics = self.admission.take_metrics() if self.admission is not None else {}
        metrics |= self.programs.take_metrics() if self.programs is not None else {}
        metrics |= self.vision.take_metrics() if self.vision is not None else {}
        return metrics | (self.sessions.take_metrics() if self.sessions is not None else {})

    async def close(self) -> None:
        """Close the open sessions, stop what this engine launched, drop the weights folder it wrote, close the
        HTTP client."""
        try:
            if self.sessions is not None and self._http is not None:
                await self.sessions.close_all()
            if self.distributed is not None and self._http is not None:
                await self.distributed.close()
            await self.processes.stop()
            if self.ray_servers is not None:
                await self.ray_servers.stop()
        finally:
            if self._http is not None:
                await self._http.aclose()
                self._http = None
            if self._written is not None:
                await asyncio.to_thread(shutil.rmtree, self._written, True)
                self._written = None

    def _salt(self) -> str:
        return cache_salt(self.cache_version)

    async def _load(self, state_dict: dict[str, Any], version: int, folder: Path | None, flush: bool) -> None:
        """One weight update on every server: the folder (`/update_weights_from_disk`), or the tensors in buckets
        (`/update_weights_from_tensor` or `_distributed`, the version set by the last) inside SGLang's weight-update
        session (`/begin_weight_update` ... `/end_weight_update`, which 0.5.23 requires for them); `flush`: SGLang
        flushes its cache after the load (and fails the call if requests run)."""
        if folder is not None:
            body: dict[str, Any] = {"model_path": str(folder), "weight_version": str(version), "flush_cache": flush}
            return self._succeeded("/update_weights_from_disk", await self._control("/update_weights_from_disk", body))
        self._succeeded("/begin_weight_update", await self._control("/begin_weight_update", {}))
        try:
            if self.distributed is not None:
                tp_sizes = [int(self.server_info.get(url, {}).get("tp_size") or 1) for url in self._targets.urls]
                await self.distributed.update(self._targets.urls, tp_sizes, state_dict, version, flush)
            else:
                tp_size = max((int(i.get("tp_size") or 1) for i in self.server_info.values()), default=1)
                async for body in tensor_bodies(state_dict, tp_size, version, flush):
                    self._succeeded("/update_weights_from_tensor",
                                    await self._control("/update_weights_from_tensor", body))
        finally:
            self._succeeded("/end_weight_update", await self._control("/end_weight_update", {}))

    async def _control(self, path: str, body: dict[str, Any]) -> list[Any]:
        """A control call on every server (pause, continue, weight loads): through smg's RL control plane when the
        engine runs smg with `--enable-rl` (`sglang/routing.py`, `rl_fanout`), else to each server directly; the
        answers in `self._targets.urls` order."""
        if self._rl is not None:
            return await self._rl.fanout(path, body)
        return await self._on_every_server(path, body)

    def _succeeded(self, path: str, answers: list[Any]) -> None:
        for url, answer in zip(self._targets.urls, answers, strict=True):
            if not answer.get("success", False):
                raise SglangError(f"SGLang server {url} refused {path}: {answer.get('message')}")

    async def _on_every_server(self, path: str, body: dict[str, Any]) -> list[Any]:
        """POST `body` to `path` on every server (never through the router); their answers."""
        return list(await asyncio.gather(*(self._call("POST", url, path, body) for url in self._targets.urls)))

    def _prompt(self, input_ids: Sequence[int], media: Sequence[ImageFeatures] | None) -> list[int]:
        if self._http is None:
            raise RuntimeError("SglangEngine is not running: call `await engine.start()` first")
        prompt = [int(i) for i in input_ids]
        if not prompt:
            raise ValueError("input_ids is empty: the prompt needs at least one token")
        length = expanded_length(prompt, media or ())
        if length > self.max_context_len:
            raise ValueError(f"prompt has {length} tokens (images expanded), more than max_context_len="
                             f"{self.max_context_len}; shorten the history or raise rollout.max_context_len")
        return prompt

    def _images(self, input_ids: Sequence[int], media: Sequence[ImageFeatures] | None) -> list[str] | None:
        """`image_data` of a prompt with images (their URLs); None without. The placeholders must match them."""
        if not media:
            return None
        if self.vision is None:
            raise ValueError(f"model {self.model_path} is text-only: generate got {len(media)} image(s)")
        return self.vision.image_data(input_ids, media)

    async def _session(self, session_id: str | None, worker: WorkerLoad, key: str) -> OpenSession | None:
        """The SGLang session of `session_id`, opened at its first turn (on `worker`; behind the router on every
        server); None without sessions."""
        if self.sessions is None or session_id is None:
            return None
        urls = self._targets.urls if self._targets.router is not None else [worker.url]
        return await self.sessions.get(session_id, urls, worker, key)

    async def _sent(self, flight: _Flight, prompt: list[int], sampling: SamplingParams, sizes: tuple[int, int],
                    key: str, session: OpenSession | None, images: list[str] | None = None) -> GenerateResult:
        """Send the generation (a session turn when `session`; `sizes`: the token limit and the KV it may hold); a
        turn the server refuses for its session is sent again as a new root of the reopened session."""
        limit, salt = sizes[0], self._salt()
        if session is None:
            body = payload(prompt, sampling, limit, flight.wire, image_data=images, salt=salt)
            result, meta = await self._admitted(flight, sizes[1], body, key)
            if images and self.vision is not None and meta:
                self.vision.served(meta, sizes[1] - limit, flight.worker.url, self.settings.image_mismatch == "refuse")
            return result
        request = session.tree.request(prompt)
        try:
            result, meta = await self._admitted(flight, len(prompt) + limit,
                                                payload(prompt, sampling, limit, flight.wire, request, salt=salt), key)
        except SglangError as error:
            if "session" not in str(error) or self.sessions is None:
                raise
            log.warning("sglang: session %s refused a turn (%s); reopening it, the turn goes as a new root",
                        request.params["id"], error)
            await self.sessions.reopen(session)
            request = session.tree.request(prompt)
            result, meta = await self._admitted(flight, len(prompt) + limit,
                                                payload(prompt, sampling, limit, flight.wire, request, salt=salt), key)
        self._session_turn(session, flight.wire, prompt, result, meta)
        return result

    def _session_turn(self, session: OpenSession, wire: str, prompt: list[int], result: GenerateResult,
                      meta: dict[str, Any]) -> None:
        """Mirror the node a session turn made; its assembled prompt must be ours."""
        if not meta:  # aborted before it was sent
            return
        served = meta.get("prompt_tokens")
        if served is not None and int(served) != len(prompt):
            session.tree.forget()
            raise SglangError(f"SGLang session {session.tree.session_id}: the server assembled {served} prompt tokens "
                              f"for a {len(prompt)}-token prompt (rid {wire}); set engine.sessions=false")
        if self.sessions is not None:
            self.sessions.turn(int(meta.get("cached_tokens") or 0))
        if result.finish_reason != "abort":
            session.tree.finished(wire, prompt, result.output_ids)

    async def _admitted(self, flight: _Flight, tokens: int, payload: dict[str, Any],
                        key: str) -> tuple[GenerateResult, dict[str, Any]]:
        """Reserve KV room (admission=kv), send the generation, release the room; the result and its meta_info."""
        worker = flight.worker
        if self.admission is not None:
            flight.admission = asyncio.ensure_future(self.admission.reserve(worker, tokens))
            try:
                await flight.admission
            except asyncio.CancelledError:
                if flight.aborted and flight.admission.cancelled():
                    return GenerateResult((), (), "abort", self.weight_version), {}
                raise
        try:
            if flight.aborted:
                return GenerateResult((), (), "abort", self.weight_version), {}
            worker.in_flight += 1
            try:
                body = await self._generate_call(worker, key, payload)
            finally:
                worker.in_flight -= 1
            return parse_generate(body, self.weight_version, worker.url), body.get("meta_info") or {}
        finally:
            if self.admission is not None:
                self.admission.release(worker, tokens)

    async def _generate_call(self, worker: WorkerLoad, key: str, payload: dict[str, Any]) -> dict[str, Any]:
        if self._targets.router is not None:
            return await self._call("POST", self._targets.router, "/generate", payload, {ROUTING_KEY_HEADER: key})
        return await self._call("POST", worker.url, "/generate", payload)

    async def _send_abort(self, rid: str, worker: WorkerLoad) -> None:
        """POST /abort_request to the worker of `rid` (every server behind a router); errors are logged."""
        urls = self._targets.urls if self._targets.router is not None else [worker.url]
        for url in urls:
            try:
                await self._call("POST", url, "/abort_request", {"rid": rid}, expect_json=False)
            except (SglangError, RuntimeError) as error:
                log.warning("abort of %s failed: %s", rid, error)

    async def _call(self, method: str, url: str, path: str, body: dict[str, Any] | None = None,
                    headers: dict[str, str] | None = None, expect_json: bool = True) -> Any:
        """One HTTP call; errors name the URL and the endpoint."""
        if self._http is None:
            raise RuntimeError("SglangEngine is closed")
        content = orjson.dumps(body) if body is not None else None
        try:
            response = await self._http.request(method, url + path, content=content, headers={
                "content-type": "application/json", **(headers or {})})
        except httpx.HTTPError as error:
            raise SglangError(f"SGLang server {url}: {method} {path} failed: {error!r}; is it running?") from error
        if response.status_code == 404:
            raise SglangError(f"SGLang server {url} has no endpoint {path} (404): this client follows the SGLang "
                              f"{SGLANG_API_VERSION} HTTP API; check the server's version")
        if not response.is_success:
            raise SglangError(f"SGLang server {url}: {method} {path} answered {response.status_code}: "
                              f"{response.text[:500]}")
        return orjson.loads(response.content) if expect_json and response.content else response.text

    async def _launch_servers(self) -> list[str]:
        """Start `servers` SGLang servers on free ports and wait until each answers /health (on Ray nodes with
        engine.placement=ray)."""
        launch = self.settings.launch_part
        if self.settings.sessions:  # sessions hold their KV only with it (mem_cache/.../session_ref_tracker.py)
            launch = replace(launch, server_args={"enable_session_radix_cache": True, **launch.server_args})
        if self.ray_servers is not None:
            return await self.ray_servers.start(launch.servers, launch.gpus_per_server, launch.command,
                                                self.model_path, launch.server_args, launch.timeout)
        return await launch_servers(self.processes, launch, self.model_path)

    def _sessions_supported(self, urls: list[str], sessions: SessionsPart | None) -> SessionsPart | None:
        """engine.sessions, checked against every server's `enable_session_radix_cache` (`/server_info`): a server
        without it is refused at start, or (engine.sessions_fallback) the engine runs without sessions (None)."""
        if sessions is None:
            return None
        without = [url for url in urls if not self.server_info.get(url, {}).get("enable_session_radix_cache")]
        if not without:
            return sessions
        why = (f"engine.sessions=true, but the SGLang server(s) {without} run without --enable-session-radix-cache: "
               "their sessions would not hold KV between turns (a session's KV is ordinary, evictable cache there)")
        if not sessions.fallback:
            raise SglangError(f"{why}; relaunch them with --enable-session-radix-cache, or set engine.sessions=false, "
                              "or engine.sessions_fallback=true to run without sessions")
        log.warning("%s; engine.sessions_fallback=true: running with engine.sessions=false", why)
        return None

    async def _start_router(self, urls: list[str]) -> str:
        """The router's URL: `router_url`, or a started smg (with its RL control plane) once it sees every worker
        healthy."""
        if self.router_url:
            return self.router_url
        router_part, host = self.settings.router_part, self.settings.host
        assert router_part is not None, "engine.router=smg"
        check_installed(router_part.command)
        port = free_port(host)
        metrics = {"prometheus_port": free_port(host), "enable_rl": True}  # its fixed port (29000) collides
        command = router_command(router_part.command, host, port, urls, metrics | router_part.args)
        router = self.processes.start("router", command)
        url = f"http://{self.settings.host}:{port}"
        await self.processes.wait_ready(router, url + "/health", self.settings.launch_timeout)
        if not await workers_healthy(partial(self._call, "GET", url), len(urls), self.settings.launch_timeout):
            raise SglangError(f"smg at {url} did not report {len(urls)} healthy workers; log "
                              f"{router.log_path}")
        return url
