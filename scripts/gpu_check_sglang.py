"""GPU check of `engine=sglang` against a real SGLang server (run by `scripts/gpu_check_sglang.sh`).

One two-step `job=train runtime=partial` run with `engine.launch=true` (a real `python -m sglang.launch_server`
on the GPU, the trainer on the same GPU) through the CLI, with `RecordingSglangEngine` as the engine class: it
records every generation (prompt ids, output ids, logprobs, finish) and, around every weight update, the greedy
logprob of a fixed prompt. Then it checks:

1. token-exact: every dump row's response tokens are exactly what the engine returned, turn by turn (each
   generation's prompt + output is a prefix of some row's tokens, and every loss-mask token of every row comes
   from a generation), with the engine's logprobs as `rollout_logprobs`;
2. the weight update was applied: the fixed prompt's logprob after the first update differs from before;
3. partial rollout ran: the run's metrics report parked groups or aborted generations (printed; an abort
   needs a step to end while a group is still generating, which the workload makes likely, not certain);
4. sessions: the launched server runs with `--enable-session-radix-cache` (`/server_info`), and each session turn
   after the first is served from the whole previous context (`meta_info.cached_tokens`, less the last token);
5. a closed session is dereferenced, not freed: its context is still served from the cache after `/close_session`;
6. `engine.weight_update=pause`: a generation runs on through a weight update, not aborted, with tokens of both
   versions;
7. the cache after a paused update: a prompt cached before it is served from no cached prefix after it (the new
   `cache_salt`), and cached again after that;
8. `engine.weight_transfer=tensor` and `distributed` (gloo) each load new weights (the probe's logprob changes);
9. images: not run (printed): no vision-language model SGLang serves is available without a download.

Prints one line per check and exits non-zero when any of checks 1, 2 and 4 to 8 fails (3 is printed only: an
abort needs a step to end while a group still generates, which the workload makes likely, not certain).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from relax_pipeline.engine.base import GenerateResult, SamplingParams
from relax_pipeline.engine.sglang.client import SglangEngine

PROBE = [1, 2, 3, 4, 5, 6, 7, 8]
"""Token ids of the fixed prompt whose greedy logprob must change with the weights."""


class RecordingSglangEngine(SglangEngine):
    """SglangEngine that appends every generation and weight-update probe to `$RELAX_GPU_CHECK_LOG`."""

    def _record(self, record: dict[str, Any]) -> None:
        with open(os.environ["RELAX_GPU_CHECK_LOG"], "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")

    async def start(self) -> None:
        await super().start()
        self._record({"kind": "start", "model": self.model_path})

    async def generate(self, input_ids: Any, sampling: SamplingParams, rid: str, media: Any = None,
                       session_id: str | None = None) -> GenerateResult:
        result = await super().generate(input_ids, sampling, rid, media, session_id=session_id)
        self._record({"kind": "generate", "prompt": list(input_ids), "output": list(result.output_ids),
                      "logprobs": list(result.logprobs), "finish": result.finish_reason,
                      "version": result.weight_version})
        return result

    async def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        before = await self._probe(f"probe-before-{version}")
        await super().update_weights(state_dict, version)
        after = await self._probe(f"probe-after-{version}")
        self._record({"kind": "update", "version": version, "before": before, "after": after})

    async def _probe(self, rid: str) -> float:
        result = await SglangEngine.generate(self, PROBE, SamplingParams(1, temperature=0.0), rid)
        return result.logprobs[0]


def run(out: Path, model_overrides: list[str]) -> int:
    """The two-step run through the CLI (extra overrides replace the defaults of the same key); its exit status."""
    env = {**os.environ, "RELAX_GPU_CHECK_LOG": str(out / "engine_calls.jsonl"),
           "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    defaults = ["job=train", "engine=sglang", "engine.launch=true",
                "engine._target_=gpu_check_sglang.RecordingSglangEngine",
                "+engine.server_args.mem_fraction_static=0.4", "runtime=partial", "rollout.num_steps=2",
                "rollout.batch_size=2", "rollout.over_sampling_batch_size=3", "rollout.n_samples_per_prompt=2",
                "rollout.max_response_len=64", "trainer.device=cuda", f"output_dir={out}",
                f"debug.save_rollout_data={out}/dump/r_{{rollout_id}}.jsonl"]
    given = {_key(arg) for arg in model_overrides}
    command = [sys.executable, "-m", "relax_pipeline", *(d for d in defaults if _key(d) not in given), *model_overrides]
    print("running:", " ".join(command), flush=True)
    return subprocess.call(command, env=env)


def _key(override: str) -> str:
    return override.partition("=")[0].lstrip("+~")


def check_tokens(out: Path) -> bool:
    calls = [json.loads(line) for line in (out / "engine_calls.jsonl").read_text().splitlines()]
    generations = [c for c in calls if c["kind"] == "generate"]  # aborted ones hold the first part of a resumed turn
    rows = [json.loads(line) for p in sorted((out / "dump").glob("r_*.jsonl")) for line in p.read_text().splitlines()]
    rows = [r for r in rows if r["status"] in ("completed", "truncated")]
    by_output: dict[tuple[int, ...], list[float]] = {}
    for g in generations:
        by_output[tuple(g["prompt"] + g["output"])] = g["logprobs"]
    bad = 0
    for row in rows:
        tokens, mask, logprobs = row["tokens"], row["loss_mask"], row["rollout_logprobs"]
        start = row["prompt_length"]
        for i, m in enumerate(mask):
            if m and not _covered(tokens[: start + i + 1], start + i, by_output, logprobs[i]):
                bad += 1
                break
    print(f"check 1 token-exact: {len(rows)} rows, {len(generations)} generations, {bad} rows not matching",
          flush=True)
    return bad == 0 and bool(rows)


def _covered(prefix: list[int], position: int, by_output: dict[tuple[int, ...], list[float]], logprob: float) -> bool:
    """Some generation produced token `position` of `prefix` with `logprob` (resumed ones: in one of its parts)."""
    for full, logprobs in by_output.items():
        prompt_len = len(full) - len(logprobs)
        if prompt_len <= position < len(full) and list(full[: position + 1]) == prefix:
            return abs(logprobs[position - prompt_len] - logprob) < 1e-6
    return False


def check_update(out: Path) -> bool:
    calls = [json.loads(line) for line in (out / "engine_calls.jsonl").read_text().splitlines()]
    updates = [c for c in calls if c["kind"] == "update"]
    changed = bool(updates) and abs(updates[0]["after"] - updates[0]["before"]) > 1e-6
    print(f"check 2 weight update: {[(u['version'], u['before'], u['after']) for u in updates]} changed={changed}",
          flush=True)
    return changed


def check_partial(out: Path) -> None:
    found = re.findall(r"step (\d+) metrics .*?rollout/aborted_generations=(\S+).*?rollout/parked_groups=(\S+)",
                       (out / "run.log").read_text())
    print("check 3 partial rollout (step, aborted generations, parked groups):", found or "no metrics logged",
          flush=True)


async def check_sessions_and_pause(out: Path) -> bool:
    """Checks 4 to 7 on a fresh server of the run's model (see the module); each one can fail."""
    from relax_pipeline.engine.settings import EngineRun, SglangEngineSettings

    calls = [json.loads(line) for line in (out / "engine_calls.jsonl").read_text().splitlines()]
    model = next(c["model"] for c in calls if c["kind"] == "start")
    settings = SglangEngineSettings(launch=True, servers=1, weight_update="pause",
                                    server_args={"mem_fraction_static": 0.4}, log_dir=str(out / "sglang-check"))
    engine = SglangEngine(settings, EngineRun(model, output_dir=str(out)))
    await engine.start()
    try:
        ok = await _sessions(engine)
        ok &= await _fresh_cache_after_paused_update(engine, model)
        return ok
    finally:
        await engine.close()


async def _cached(engine: SglangEngine, ids: list[int], rid: str) -> int:
    """A plain one-token /generate of `ids` sent straight to the server; its `meta_info.cached_tokens`."""
    from relax_pipeline.engine.sglang.wire import payload

    body = payload(list(ids), SamplingParams(1, temperature=0.0), 1, rid, salt=engine._salt())
    answer = await engine._call("POST", engine._targets.urls[0], "/generate", body)
    return int(answer["meta_info"].get("cached_tokens") or 0)


async def _sessions(engine: SglangEngine) -> bool:
    """4: the launched server has --enable-session-radix-cache; each session turn after the first is served from the
    whole previous context (less its last token, whose KV was never computed); greedy equality with plain requests
    is printed (GPU numerics may differ between kept and recomputed KV). 5: after /close_session the context is
    still cached (dereferenced, not freed)."""
    flag = engine.server_info[engine._targets.urls[0]].get("enable_session_radix_cache") is True
    greedy, prompt, kept, contexts, same = SamplingParams(16, temperature=0.0), list(PROBE), [], [], True
    for turn in range(3):
        engine.step_metrics()
        served = await engine.generate(prompt, greedy, f"s{turn}", session_id="check")
        kept.append(engine.step_metrics()["engine/session_cached_tokens"])
        plain = await engine.generate(prompt, greedy, f"p{turn}")
        same &= served.output_ids == plain.output_ids
        context = prompt + list(served.output_ids)
        contexts.append(len(context))
        prompt = context + PROBE
    held = all(kept[i] >= contexts[i - 1] - 1 for i in range(1, len(kept)))
    await engine.close_session("check")
    after_close = await _cached(engine, context, "after-close")
    dereferenced = after_close >= len(context) - 1
    print(f"check 4 sessions: --enable-session-radix-cache {flag}; cached per turn {kept} of contexts {contexts}; "
          f"kept the previous context: {held}; greedy equal to plain requests: {same}", flush=True)
    print(f"check 5 closed session dereferenced, not freed: {after_close} of {len(context)} context tokens still "
          f"cached: {dereferenced}", flush=True)
    return flag and held and dereferenced


async def _fresh_cache_after_paused_update(engine: SglangEngine, model: str) -> bool:
    """6: a generation runs on through a paused update (not aborted, tokens of both versions). 7: a prompt cached
    before that update is served from no cached prefix after it (new cache_salt), then is cached again."""
    warm = list(PROBE) * 4
    await _cached(engine, warm, "warm")
    before = await _cached(engine, warm, "warm-again")
    task = asyncio.create_task(engine.generate(PROBE, SamplingParams(512, temperature=1.0, seed=1), "long"))
    await asyncio.sleep(0.2)
    await engine.update_weights(await asyncio.to_thread(_weights, model), 1)
    result = await task
    went_on = result.finish_reason != "abort" and set(result.token_versions) == {0, 1}
    print(f"check 6 pause: finish {result.finish_reason}, {len(result.output_ids)} tokens, versions "
          f"{sorted(set(result.token_versions))}: {went_on}", flush=True)
    after, again = await _cached(engine, warm, "after"), await _cached(engine, warm, "after-again")
    fresh = before >= len(warm) - 1 and after == 0 and again >= len(warm) - 1
    print(f"check 7 cache after a paused update: cached before {before}, first after {after}, then {again} of "
          f"{len(warm)}: {fresh}", flush=True)
    return went_on and fresh


async def check_transfers(out: Path) -> bool:
    """8: weight_transfer=tensor and =distributed (gloo: this process shares the GPU with the server) each load new
    weights: the probe's greedy logprob changes."""
    from relax_pipeline.engine.settings import EngineRun, SglangEngineSettings

    model = next(json.loads(line)["model"] for line in (out / "engine_calls.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "start")
    moved = await asyncio.to_thread(_moved, model)
    ok = True
    for transfer, backend in (("tensor", None), ("distributed", "gloo")):
        settings = SglangEngineSettings(launch=True, servers=1, weight_transfer=transfer, weight_backend=backend,
                                        server_args={"mem_fraction_static": 0.4},
                                        log_dir=str(out / f"sglang-{transfer}"))
        engine = SglangEngine(settings, EngineRun(model, output_dir=str(out)))
        await engine.start()
        try:
            probe = SamplingParams(1, temperature=0.0)
            before = (await engine.generate(PROBE, probe, "before")).logprobs[0]
            await engine.update_weights(moved, 1)
            after = await engine.generate(PROBE, probe, "after")
            changed = abs(after.logprobs[0] - before) > 1e-6 and after.weight_version == 1
        finally:
            await engine.close()
        print(f"check 8 weight_transfer={transfer}: probe logprob {before} -> {after.logprobs[0]}, version "
              f"{after.weight_version}: {changed}", flush=True)
        ok &= changed
    print("check 9 images: NOT RUN (no vision-language model SGLang serves is available without a download)",
          flush=True)
    return ok


def _moved(model: str) -> dict[str, Any]:
    import torch

    weights = _weights(model)
    generator = torch.Generator().manual_seed(0)
    return {k: v + 0.01 * torch.randn(v.shape, generator=generator, dtype=v.dtype) if v.is_floating_point() else v
            for k, v in weights.items()}


def _weights(model: str) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model).state_dict()


def main() -> int:
    out = Path(sys.argv[1]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    status = run(out, sys.argv[2:])
    print(f"run exit status {status}", flush=True)
    if status != 0:
        return status
    ok = check_tokens(out) & check_update(out)
    check_partial(out)
    ok &= asyncio.run(check_sessions_and_pause(out))
    ok &= asyncio.run(check_transfers(out))
    print("GPU CHECK", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
