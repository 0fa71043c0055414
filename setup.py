"""scale_llm: pretrain GPT-style language models from one YAML file, on one CPU or many GPUs."""

import os
import re
import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

here = Path(__file__).parent
version = {}
exec((here / "scale_llm" / "version.py").read_text(), version)

# Launchers that make sense outside a checkout (setup.sh, test.sh and quickstart.sh build .venv).
SHIPPED_LAUNCHERS = (
    "_env.sh",
    "2xh100.sh",
    "torchrun.sh",
    "deepspeed.sh",
    "slurm.sbatch",
    "gpu-check.sh",
)


class BuildWithConfigs(build_py):
    """A wheel carries the shipped configs (scale_llm/configs/*.yaml: `scale-llm train tiny`
    finds them by name) and the launchers (scale_llm/launch/; `scale-llm config --paths`)."""

    def run(self):
        super().run()
        package = Path(self.build_lib) / "scale_llm"
        configs, launch = package / "configs", package / "launch"
        configs.mkdir(parents=True, exist_ok=True)
        launch.mkdir(parents=True, exist_ok=True)
        for config in sorted((here / "yaml").glob("*.yaml")):
            shutil.copy2(config, configs / config.name)
        for name in SHIPPED_LAUNCHERS:
            shutil.copy2(here / "launch" / name, launch / name)


def long_description() -> str:
    """The README with its relative links made absolute (a package index renders them
    outside the repository): against $SCALE_LLM_SOURCE_URL, e.g. .../blob/main/, when set."""
    text = (here / "README.md").read_text(encoding="utf-8")
    base = os.environ.get("SCALE_LLM_SOURCE_URL", "").rstrip("/")
    if not base:
        return text
    return re.sub(r"\]\((?!https?://|#)([^)]+)\)", lambda m: f"]({base}/{m.group(1)})", text)


setup(
    name="scale_llm",
    version=version["__version__"],
    description="Pretrain LLMs from raw text to generated text with DDP, FSDP2 or DeepSpeed.",
    long_description=long_description(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["scale_llm", "scale_llm.*"]),
    install_requires=[
        # Lower bound only: GPU users keep the CUDA build they installed; launch/setup.sh
        # pins the CPU build (torch==2.13.0) on machines without a GPU.
        "torch>=2.6",
        "deepspeed>=0.16",
        "datasets>=3.0",
        "pyarrow>=15.0",  # local .parquet sources (also a dependency of datasets)
        "sentencepiece>=0.2",
        "pyyaml>=6.0",
        "tensorboard>=2.16",
        "numpy>=1.26",
        "tqdm>=4.66",
        "xxhash>=3.0",  # checkpoint integrity records (also a dependency of datasets)
    ],
    extras_require={
        "dev": ["pytest>=8.0", "pytest-xdist>=3.5", "ruff>=0.6", "wandb>=0.18"],  # wandb: its test
        "wandb": ["wandb>=0.18"],
        # the ecosystem bridges: `scale-llm export`, `model.init_from`, `scale-llm eval`
        # (tested with transformers 5.24, tokenizers 0.23, safetensors 0.8, lm_eval 0.4.13,
        # accelerate 1.15)
        "hf": [
            "transformers>=5.0",
            "tokenizers>=0.21",
            "safetensors>=0.4",
            "lm-eval>=0.4.9",
            "accelerate>=0.26",  # lm-eval's `hf` model class imports it
        ],
        # train.fp8: torchao's Float8Linear (0.18.0 loads beside torch 2.11 and newer; its float8
        # API moves between releases, so one tested version)
        "fp8": ["torchao==0.18.0"],
    },
    entry_points={"console_scripts": ["scale-llm=scale_llm.cli:entry"]},
    cmdclass={"build_py": BuildWithConfigs},
)
