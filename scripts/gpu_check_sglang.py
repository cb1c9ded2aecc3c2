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
4. sessions (`engine.sessions`): a fresh server on the run's model, a three-turn greedy session whose turns send
   only their new tokens, the session keeping the rest (`engine/session_cached_tokens` > 0), closed at the end
   (greedy equality with plain requests is printed: GPU numerics may differ between a kept and a recomputed KV);
5. `engine.weight_update=pause`: a weight update amid a long generation, which is not aborted (its per-token
   versions are printed).

Prints one line per check and exits non-zero when check 1, 2 or 4 fails.
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
    """Checks 4 and 5 on a fresh server of the run's model (see the module)."""
    from relax_pipeline.engine.settings import EngineRun, SglangEngineSettings

    calls = [json.loads(line) for line in (out / "engine_calls.jsonl").read_text().splitlines()]
    model = next(c["model"] for c in calls if c["kind"] == "start")
    settings = SglangEngineSettings(launch=True, servers=1, weight_update="pause",
                                    server_args={"mem_fraction_static": 0.4}, log_dir=str(out / "sglang-check"))
    engine = SglangEngine(settings, EngineRun(model, output_dir=str(out)))
    await engine.start()
    try:
        greedy, prompt, same = SamplingParams(16, temperature=0.0), list(PROBE), True
        for turn in range(3):
            served = await engine.generate(prompt, greedy, f"s{turn}", session_id="check")
            plain = await engine.generate(prompt, greedy, f"p{turn}")
            same &= served.output_ids == plain.output_ids
            prompt = prompt + list(served.output_ids) + PROBE
        await engine.close_session("check")
        metrics = engine.step_metrics()
        ok = metrics["engine/session_cached_tokens"] > 0 and metrics["engine/sessions_open"] == 0
        print(f"check 4 sessions: {metrics}, greedy equal to plain requests: {same}", flush=True)
        task = asyncio.create_task(engine.generate(PROBE, SamplingParams(512, temperature=1.0, seed=1), "long"))
        await asyncio.sleep(0.2)
        await engine.update_weights(await asyncio.to_thread(_weights, model), 1)
        result = await task
        print(f"check 5 pause: finish {result.finish_reason}, {len(result.output_ids)} tokens, versions "
              f"{sorted(set(result.token_versions))}", flush=True)
        return ok and result.finish_reason != "abort"
    finally:
        await engine.close()


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
    print("GPU CHECK", "PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
