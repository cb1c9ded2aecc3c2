"""`job=replay replay.bundle=PATH`: re-execute one recorded step's credit and loss on a CPU, no engine, no agents.

Stages, each printed with its verdict: `format` (the bundle's version is one this code reads, else a clear
refusal naming both), `credit` (the configured credit class, or the command line's edited one, re-scores every
recorded group from the same inputs: rewards and advantages compared bit for bit), `batch` (the credited rows
rebuilt from that credit against the batch the trainer got), `loss` and `grad_norm` (the step trained again from
the checkpoint before it, `loss.py`, compared with the recorded metrics; tolerances named). With `credit.*`
overrides on the command line the step is also trained on the edited credit, and a diff per context shows the
advantage and the loss share that changed, then the loss and gradient norm the edit gives.

The credit node is the bundle's own, with every `credit.*` key the command line sets to other than its default
(`credit=reward`'s, `credit_overrides`) laid over it: `credit=custom_advantage credit.advantage_path=mine.fn` edits
one function and keeps the rest. `replay_run` makes those records from the `replay` node (`replay/settings.py`),
checking the folder first (it exists and holds a bundle; the error names `replay.bundle`, the value and the fix),
and reads the bundle's recorded `config.yaml` with OmegaConf (the one config this module reads).

What it does not do: start an engine, agents, a gateway or Ray; write into the run's folders; replay DeepSpeed
ranks (one CPU process computes the same step).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from relax_pipeline.credit.settings import CreditSettings
from relax_pipeline.forest.sample import Sample
from relax_pipeline.replay import credit as rc
from relax_pipeline.replay import format as fmt
from relax_pipeline.replay import loss as rl
from relax_pipeline.replay.settings import ReplaySettings
from relax_pipeline.train.settings import TrainerSettings

BUNDLE_FIX = "point it at a <output>/replay/step_<n> folder written with debug.replay_bundle=true"


def credit_overrides(node: dict[str, Any]) -> dict[str, Any]:
    """The `credit.*` keys of `node` that differ from the default credit node (what the command line edited)."""
    default = asdict(CreditSettings())
    return {k: v for k, v in node.items() if k in default and v != default[k]}


@dataclass(frozen=True)
class ReplayRun:
    """What `job=replay` re-runs; connects the command line and the bundle's config (made into records by
    `replay_run`) to the stages."""

    bundle: Path
    checkpoint: str | None
    """`replay.checkpoint`: the folder from before the step; None: the one the bundle names."""
    credit: CreditSettings
    """The bundle's credit node with `overrides` laid over it."""
    overrides: dict[str, Any]
    """The `credit.*` keys the command line edited (empty: the recorded credit)."""
    train: rl.TrainSetup


def replay_run(settings: ReplaySettings, credit: CreditSettings) -> ReplayRun:
    """`job=replay`'s records: the bundle's own config (its format version checked first) with the command line's
    `credit.*` edits (those of `credit` that differ from the default node) laid over its credit node, and its
    trainer node as `trainer=torch` on the CPU."""
    folder = bundle_folder(settings.bundle)
    fmt.read_manifest(folder)
    recorded = OmegaConf.create((folder / fmt.CONFIG).read_text())
    overrides = credit_overrides(asdict(credit))
    merged = OmegaConf.merge(OmegaConf.structured(CreditSettings), recorded.get("credit") or {}, overrides)
    trainer = OmegaConf.merge(OmegaConf.structured(TrainerSettings),
                              rl.torch_keys(OmegaConf.to_container(recorded.get("trainer") or {})))  # type: ignore[arg-type]
    credit_record: CreditSettings = OmegaConf.to_object(merged)  # type: ignore[assignment]
    train = rl.TrainSetup(OmegaConf.to_object(trainer), int(recorded.get("seed", 0)),  # type: ignore[arg-type]
                          float(recorded.rollout.temperature), credit_record.advantages)
    return ReplayRun(folder, settings.checkpoint, credit_record, overrides, train)


def bundle_folder(bundle: str | None) -> Path:
    """`replay.bundle` as a folder that exists; the error names the key, the value and the fix."""
    if not bundle:
        raise ValueError(f"job=replay needs replay.bundle=FOLDER: {BUNDLE_FIX}")
    folder = Path(bundle).expanduser()
    if not folder.exists():
        raise ValueError(f"replay.bundle={bundle!r} does not exist: {BUNDLE_FIX}")
    if not folder.is_dir():
        raise ValueError(f"replay.bundle={bundle!r} is a file, not a folder: {BUNDLE_FIX}")
    return folder


def replay(run: ReplayRun) -> dict[str, float]:
    """Run every stage on the bundle, printing each verdict; returns `replay/...` metrics (1.0: identical)."""
    started = time.perf_counter()
    step = StepReplay(run)
    metrics = asyncio.run(step.credit_stage())
    metrics.update(step.loss_stage())
    metrics["replay/time_s"] = time.perf_counter() - started
    say(f"replay of step {step.manifest['step']} done in {metrics['replay/time_s']:.2f}s")
    return metrics


class StepReplay:
    """One bundle's replay: the recorded step, the credit to apply, and what the credit stage found."""

    def __init__(self, run: ReplayRun) -> None:
        self.run, self.folder, self.overrides = run, run.bundle, run.overrides
        self.manifest = fmt.read_manifest(run.bundle)
        say(f"format: version {self.manifest['format_version']} (this code reads {fmt.FORMAT_VERSION}): OK; step "
            f"{self.manifest['step']}, written by {self.manifest['code_version']}")
        self.metrics: dict[str, Any] = json.loads((run.bundle / fmt.METRICS).read_text())
        self.groups: list[rc.Replayed] = []
        self.diffs: list[rc.ContextDiff] = []

    async def credit_stage(self) -> dict[str, float]:
        """Re-score every recorded group; compare rewards, advantages and filters bit for bit."""
        credit = credit_class(self.run.credit._target_)(self.run.credit)
        lines, rows = fmt.read_jsonl(self.folder / fmt.CREDIT), fmt.read_jsonl(self.folder / fmt.ROWS)
        self.groups = rc.rebuild_groups(lines, rows)
        await rc.rescore(credit, self.groups)
        self.diffs = rc.compare(self.groups)
        notes = rc.filter_changes(self.groups) + [f"group {g.group.id} failed: {g.failed}" for g in self.groups
                                                  if g.failed]
        changed = sum(not d.identical for d in self.diffs) + len(notes)
        edited = f" with overrides {self.overrides}" if self.overrides else ""
        say(f"credit{edited}: {len(self.diffs)} contexts in {len(self.groups)} groups: "
            + ("identical (bit-exact)" if not changed else f"{changed} differ"))
        for note in notes:
            say(f"  {note}")
        return {"replay/credit_identical": float(not changed), "replay/contexts": float(len(self.diffs))}

    def loss_stage(self) -> dict[str, float]:
        """The batch compared; then, from the checkpoint before the step, the loss and gradient norm."""
        if "train/samples" not in self.metrics:
            say("batch: the step trained nothing (job=rollout): its credit is all there is to replay")
            return {}
        recorded, replayed = rl.batch_samples(self.folder), rc.train_rows(self.groups)
        same_batch = same_rows([s for _, s in recorded], [s for _, s in replayed])
        say(f"batch: {len(replayed)} credited rows against {len(recorded)} recorded: "
            + ("identical (bit-exact)" if same_batch else "differ"))
        if self.overrides:
            self._context_diff(rl.loss_shares(recorded), rl.loss_shares(replayed))
        out = {"replay/batch_identical": float(same_batch)}
        start, line = rl.checkpoint_for(self.manifest, self.run.checkpoint)
        if start is None:
            say(f"loss: skipped: {line}")
            return out
        say(f"loss: training on the CPU from {line}")
        out.update(self._compare("recorded credit", rl.train_step(start, self.run.train, [s for _, s in recorded])))
        if self.overrides and replayed:
            edited = rl.train_step(start, self.run.train, [s for _, s in replayed])
            for key in ("train/loss", "train/grad_norm"):
                say(f"{key.split('/')[1]} with the edited credit: {edited.get(key)!r} (recorded "
                    f"{self.metrics.get(key)!r}, diff {_gap(self.metrics.get(key), edited.get(key))})")
            out.update({"replay/edited_loss": edited.get("train/loss", float("nan")),
                        "replay/edited_grad_norm": edited.get("train/grad_norm", float("nan"))})
        return out

    def _compare(self, what: str, trained: dict[str, float]) -> dict[str, float]:
        loss = rl.verdict(self.metrics.get("train/loss"), trained.get("train/loss"), rl.LOSS_RTOL)
        norm = rl.verdict(self.metrics.get("train/grad_norm"), trained.get("train/grad_norm"), rl.GRAD_NORM_RTOL)
        say(f"loss ({what}): {loss}")
        say(f"grad_norm ({what}): {norm}")
        return {"replay/loss": trained.get("train/loss", float("nan")),
                "replay/grad_norm": trained.get("train/grad_norm", float("nan")),
                "replay/loss_identical": float(loss.startswith("identical")),
                "replay/loss_within_tolerance": float(loss.startswith(("identical", "within"))),
                "replay/grad_norm_within_tolerance": float(norm.startswith(("identical", "within")))}

    def _context_diff(self, before: dict[rc.Key, float], after: dict[rc.Key, float]) -> None:
        """Per context: advantage recorded → replayed, loss share (−A·tokens/Σtokens) recorded → replayed."""
        say("  context (group/slot/name)   advantage recorded -> replayed   loss share recorded -> replayed")
        for d in self.diffs:
            name = f"{d.group_id}/{d.slot}/{d.name}{'' if d.branch is None else f'#{d.branch}'}"
            say(f"  {name}: {_num(d.advantage[0])} -> {_num(d.advantage[1])}   {_num(before.get(d.key))} -> "
                f"{_num(after.get(d.key))}{'' if d.identical else '  *'}")


def credit_class(dotted: str) -> Any:
    """The credit class a `credit._target_` names (`module.Class`)."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def same_rows(a: list[Sample], b: list[Sample]) -> bool:
    """Two trainer batches hold the same rows, bit for bit, in the same order."""
    keys = ("tokens", "prompt_length", "loss_mask", "rollout_logprobs")
    return len(a) == len(b) and all(all(getattr(x, k) == getattr(y, k) for k in keys)
                                    and rc.same(x.advantage, y.advantage) for x, y in zip(a, b, strict=True))


def _gap(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{b - a:+.6g}"


def _num(value: float | None) -> str:
    return "None" if value is None else f"{value:+.6f}"


def say(line: str) -> None:
    """One line of the replay's report, on stdout."""
    print(f"replay: {line}", flush=True)
