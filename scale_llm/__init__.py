"""scale_llm: pretrain GPT-style language models from one YAML file."""

from scale_llm.version import __version__

__all__ = ["__version__"]
