"""mini-swe-agent: its `DefaultAgent` with the built-in `mini.yaml` config, a `LitellmModel` (tool-call mode:
one `bash` tool on Chat Completions) and a `LocalEnvironment` in the current folder.

Configured only from the environment: the endpoint `OPENAI_BASE_URL` and key `OPENAI_API_KEY` (the agent
contract) go to litellm's `hosted_vllm/<RELAX_MODEL>` provider as `api_base`/`api_key`. The preset sets
`MSWEA_CONFIGURED=true` (no first-run setup), `MSWEA_COST_TRACKING=ignore_errors` (our model has no price) and
`LITELLM_LOCAL_MODEL_COST_MAP=True` (litellm fetches no cost map: it stays offline). The agent ends when a
command prints `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`; the conversation is exported implicitly.
"""

from __future__ import annotations

import os

from common import task_prompt
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import get_config_from_spec
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel


def main() -> None:
    config = get_config_from_spec("mini.yaml")
    endpoint = {"api_base": os.environ["OPENAI_BASE_URL"], "api_key": os.environ["OPENAI_API_KEY"]}
    model = LitellmModel(model_name=f"hosted_vllm/{os.environ['RELAX_MODEL']}", **{
        **config["model"], "model_kwargs": {**config["model"].get("model_kwargs", {}), **endpoint}})
    environment = LocalEnvironment(**config["environment"], cwd=os.getcwd())
    agent = DefaultAgent(model, environment, **config["agent"])
    result = agent.run(task=task_prompt())
    print(result.get("exit_status"), result.get("submission", ""))
    if result.get("exit_status") != "Submitted":
        raise SystemExit(f"mini-swe-agent ended with {result.get('exit_status')}")


if __name__ == "__main__":
    main()
