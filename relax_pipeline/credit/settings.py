"""The `credit` node as one record: what every `credit=` option takes, declared once.

`CreditSettings` holds the keys of all four options (`reward`, `custom_rm`, `group_rm`, `custom_advantage`);
each option's yaml names its class in `_target_`, and the class refuses a path key it does not use. The
estimator, KL shaping and whitening keys are also the trainer's: `advantages` hands them to it as the train
floor's `AdvantageSettings`, so the credit classes read only what scoring needs.

What it does not do: load user functions or score anything (credit/reward.py and its subclasses do).
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_pipeline.train.advantages import AdvantageSettings


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
        self.advantages  # noqa: B018 - the trainer's record checks estimator and kl_coef, naming them

    @property
    def advantages(self) -> AdvantageSettings:
        """The keys the trainer must agree on: estimator, KL shaping, whitening."""
        return AdvantageSettings(self.estimator, self.kl_coef, self.normalize_advantages)
