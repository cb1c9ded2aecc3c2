"""Build script for what pyproject.toml cannot say: the repository's `examples/` ships inside the package.

A wheel carries `examples/` as `relax_pipeline/examples/`, so the default run (`agent=digits`,
`dataset=digits`) and the other built-in presets work from a non-editable install; from a checkout the
config resolver `relax_root` points at the repository instead (`config.py`). Everything else is in
pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

SKIP = ["*__pycache__*", "*.egg-info*"]
PACKAGES = find_namespace_packages(include=["relax_pipeline*"], exclude=SKIP)
EXAMPLES = ["relax_pipeline.examples",
            *(f"relax_pipeline.examples.{p}" for p in find_namespace_packages("examples", exclude=SKIP))]
DATA = ["*.yaml", "*.jinja", "*.txt", "*.jsonl", "*.json", "*.md", "*.sh", "*.png", "*.html", "*.js", "*.css",
        "LICENSE"]  # LICENSE: a vendored library's licence (view/static/vendor/)

setup(
    packages=[*PACKAGES, *EXAMPLES],
    package_dir={"relax_pipeline.examples": "examples"},
    package_data={"": DATA},  # "" is every package
)
