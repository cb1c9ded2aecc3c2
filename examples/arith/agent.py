"""`agent=arith`: one model call per session through the OpenAI SDK; the reward is the exact answer.

The session's input holds one user message ("What is 12 + 34? Answer with just the number.") and the
answer in `metadata.answer` (`dataset=arith`). The agent asks the model once and writes
`{"reward", "metadata"}`: reward 1.0 when the reply's last number is the answer
(`relax_pipeline.credit.examples.answer_reward`), and `has_number` (whether the reply holds an integer at all),
which separates getting the format right from getting the sum right. The conversation is exported implicitly.
"""

import json
import os

from openai import OpenAI

from relax_pipeline.credit.examples import answer_reward, last_integer


def main() -> None:
    with open(os.environ["RELAX_INPUT_JSON"], encoding="utf-8") as f:
        task = json.load(f)
    client = OpenAI(base_url=os.environ["RELAX_BASE_URL"], api_key=os.environ["RELAX_API_KEY"], max_retries=0)
    response = client.chat.completions.create(model=os.environ["RELAX_MODEL"], messages=task["messages"])
    reply = response.choices[0].message.content or ""
    reward = answer_reward(reply, task["metadata"]["answer"])
    with open(os.environ["RELAX_OUTPUT_JSON"], "w", encoding="utf-8") as f:
        json.dump({"reward": reward, "metadata": {"has_number": float(last_integer(reply) is not None)}}, f)


if __name__ == "__main__":
    main()
