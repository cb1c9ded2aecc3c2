"""The Ray runtime of one run: joined once, on first use, by whichever part needs it; left at the end.

`connect(settings)` takes the run's `ray.*` keys (`address`, `num_cpus`, `runtime_env`) and returns the `ray`
module, initialised: `address=None` starts a local Ray instance owned by this run (`ray.shutdown()` at the end),
any other address joins that cluster (`auto`, `HOST:6379`, `ray://HOST:10001`). When Ray is already initialised
in this process (a test that built a `ray.cluster_utils.Cluster`, a sweep job run by the Hydra Ray launcher) it is
used as it is and left running. `on_shutdown(hook)` registers what must end before Ray does (the agent runners,
the engine's server hosts); `shutdown()` runs the hooks, then leaves Ray when this run started it. `node_ip()`
is the address other processes of the cluster reach this one by.

Ray is imported here lazily: a run that does not use it never imports it, and a missing `ray` package is an
error naming the extra to install.

Not done here: starting or scaling a cluster (`ray start`, the autoscaler), authentication to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("relax_pipeline")

INSTALL_HINT = "pip install 'relax_pipeline[ray]' (ray[default]==2.60.0)"
"""What to install for agent.executor=ray and engine.placement=ray."""

_state: dict[str, Any] = {"owned": False, "hooks": []}


def import_ray() -> Any:
    """The `ray` module, or an ImportError naming the extra."""
    try:
        import ray
    except ImportError as error:
        raise ImportError(f"Ray is not installed: agent.executor=ray and engine.placement=ray need it; "
                          f"{INSTALL_HINT}") from error
    return ray


def connect(settings: Mapping[str, Any] | None = None) -> Any:
    """The initialised `ray` module for this run (see the module); idempotent."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    settings = dict(settings or {})
    address = settings.get("address")
    kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING,
                              "runtime_env": dict(settings.get("runtime_env") or {}) or None}
    if address is None:
        ray.init(address="local", num_cpus=settings.get("num_cpus"), **kwargs)
    else:
        ray.init(address=address, **kwargs)
    _state["owned"] = True
    log.info("ray: %s (%s)", "started a local instance" if address is None else f"joined {address}",
             ", ".join(f"{k}={v:g}" for k, v in sorted(ray.cluster_resources().items()) if k in ("CPU", "GPU")))
    return ray


def on_shutdown(hook: Callable[[], None]) -> None:
    """Run `hook` at `shutdown`, before Ray is left (hooks run newest first)."""
    _state["hooks"].append(hook)


def shutdown() -> None:
    """Run the hooks, then leave Ray if this run started it; a no-op when Ray was never used."""
    hooks, _state["hooks"] = _state["hooks"], []
    for hook in reversed(hooks):
        try:
            hook()
        except Exception as error:  # one failing hook must not keep the others from running
            log.warning("ray: shutdown hook %s failed: %s", getattr(hook, "__qualname__", hook), error)
    if _state["owned"]:
        _state["owned"] = False
        import_ray().shutdown()


def node_ip() -> str:
    """This process's address on the Ray cluster (what a server started here binds and advertises)."""
    return import_ray().util.get_node_ip_address()
