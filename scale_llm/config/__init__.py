"""The bottom layer: a run's configuration (the section modules, assembled in `sections`; `load`:
YAML, `--set`, typing, writing back; `validate`; `keys`: the key reference) and its plan (`plan`:
every `auto` settled once). Nothing here imports another part of scale_llm but `errors`, `files`."""

from scale_llm.config.data import DataConfig
from scale_llm.config.load import (
    all_keys,
    build_section,
    deep_merge,
    dump_yaml,
    load_config,
    run_defining_keys,
    save_config,
    shipped_config_dir,
    to_dict,
    with_changes,
)
from scale_llm.config.parallel import ActivationCheckpointingConfig
from scale_llm.config.sections import Config, ModelConfig, RunConfig, TrainConfig, compiles, get_key
from scale_llm.config.validate import format_errors, validate
from scale_llm.errors import short

__all__ = [
    "ActivationCheckpointingConfig",
    "Config",
    "DataConfig",
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "all_keys",
    "build_section",
    "compiles",
    "deep_merge",
    "dump_yaml",
    "format_errors",
    "get_key",
    "load_config",
    "run_defining_keys",
    "save_config",
    "shipped_config_dir",
    "short",
    "to_dict",
    "validate",
    "with_changes",
]
