"""The `credit` node as one record: what every `credit=` option takes, declared once.

`CreditSettings` holds the keys of all four options (`reward`, `custom_rm`, `group_rm`, `custom_advantage`);
each option's yaml names its class in `_target_`, and the class refuses a path key it does not use. The
estimator, KL shaping and whitening keys are also the trainer's: `advantages` hands them to it as
`AdvantageSettings`, declared here with the estimator names (credit owns them; the trainer's
`train/advantages.py` reads them), so the credit classes read only what scoring needs.

What it does not do: load user functions or score anything (credit/reward.py and its subclasses do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
KL_SHAPING_ESTIMATORS: tuple[str, ...] = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def check_estimator(estimator: str) -> None:
    """Raise a ValueError naming `credit.estimator` when `estimator` is not one of ESTIMATORS."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"credit.estimator={estimator!r}; choose one of {list(ESTIMATORS)}")


def check_kl_coef(estimator: str, kl_coef: float) -> None:
    """KL reward shaping needs a finite coefficient >= 0, and > 0 only with a reinforce++ estimator."""
    if not math.isfinite(kl_coef) or kl_coef < 0:
        raise ValueError(f"credit.kl_coef must be a finite number >= 0, got {kl_coef}")
    if kl_coef > 0 and estimator not in KL_SHAPING_ESTIMATORS:
        raise ValueError(f"credit.kl_coef={kl_coef} (KL reward shaping) is not supported by credit.estimator="
                         f"{estimator!r}; use one of {list(KL_SHAPING_ESTIMATORS)} or set "
                         "trainer.loss.use_kl_loss=true with trainer.loss.kl_loss_coef instead")


@dataclass
class AdvantageSettings:
    """The credit keys the trainer agrees on; connects the `credit` group to the trainer's step."""

    estimator: str = "grpo"
    """credit.estimator: how base scalars spread over tokens (reinforce++ writes returns-to-go)."""
    kl_coef: float = 0.0
    """credit.kl_coef: KL reward shaping (reinforce++ estimators only); > 0 needs a reference model."""
    normalize_advantages: bool = False
    """credit.normalize_advantages: whiten token advantages over the global batch."""

    def __post_init__(self) -> None:
        check_estimator(self.estimator)
        check_kl_coef(self.estimator, self.kl_coef)


@dataclass
class CreditSettings:
    """The `credit` group's node; connects the config to the credit class its `_target_` names."""

    _target_: str = "relax_pipeline.credit.reward.RewardCredit"
    """The credit class this node builds (each `credit=` option's yaml names its own)."""
    reward_key: str | None = None
    """Key of the primary value when an exported reward is an object."""
    rm_path: str | None = None
    """module.function custom reward model (credit=custom_rm, credit=group_rm)."""
    advantage_path: str | None = None
    """module.function per-context advantage hook (credit=custom_advantage; optional with credit=group_rm)."""
    estimator: str = "grpo"
    """Advantage estimator: grpo, rloo, reinforce_plus_plus or reinforce_plus_plus_baseline."""
    normalize_std: bool = True
    """GRPO: divide the group-centred reward by the group's std."""
    kl_coef: float = 0.0
    """KL reward shaping coefficient (reinforce_plus_plus estimators; applied by the trainer)."""
    normalize_advantages: bool = False
    """Whiten token advantages across the batch (applied by the trainer)."""
    log_passrate: bool = False
    """Log `passrate` (primary reward == 1)."""
    filter_path: str | None = None
    """module.function(samples) -> bool: keep a scored train group; False filters it and its prompt returns."""
    metrics_path: str | None = None
    """module.function(rows) -> dict[str, float]: the user's own metrics of each train step's dump rows, logged as
    `rollout/user/<name>` (credit/user_metrics.py)."""
    truncated_reward: float = 0.0
    """Reward of a session recorded as truncated by our length limit when the agent then failed (no reward
    exported); a reward model, when configured, scores it first."""

    def __post_init__(self) -> None:
        self.advantages  # noqa: B018 - the advantage record checks estimator and kl_coef, naming them

    @property
    def advantages(self) -> AdvantageSettings:
        """The keys the trainer must agree on: estimator, KL shaping, whitening."""
        return AdvantageSettings(self.estimator, self.kl_coef, self.normalize_advantages)
