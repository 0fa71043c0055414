"""The bottom layer: a run's configuration and its plan.

- `sections`, `data`, `parallel`, `profile`: the config tree, one dataclass per section, each
  key declared with its default and its help (`schema.config_key`);
- `load`: YAML (with `base:`), `--set` overrides, typing, and writing a config back;
- `validate`: values and combinations that typing cannot catch;
- `plan`: `resolve_plan(cfg, launch) -> RunPlan`, every `auto` settled once;
- `keys`: the key reference docs/config.md holds.

Nothing here imports another part of scale_llm but `errors` and `files`.
"""

from scale_llm.config.data import DataConfig, SourceConfig
from scale_llm.config.load import (
    all_keys,
    build_section,
    deep_merge,
    dump_yaml,
    expand_home,
    load_config,
    resolve_config_path,
    run_defining_keys,
    save_config,
    shipped_config_dir,
    to_dict,
    with_changes,
)
from scale_llm.config.parallel import (
    ActivationCheckpointingConfig,
    DDPConfig,
    DeepSpeedConfig,
    FSDPConfig,
    ParallelConfig,
)
from scale_llm.config.profile import ProfileConfig
from scale_llm.config.sections import (
    CheckpointConfig,
    Config,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    RunConfig,
    TrainConfig,
    WandbConfig,
    compiles,
    get_key,
)
from scale_llm.config.validate import format_errors, validate
from scale_llm.errors import short

__all__ = [
    "ActivationCheckpointingConfig",
    "CheckpointConfig",
    "Config",
    "DDPConfig",
    "DataConfig",
    "DeepSpeedConfig",
    "EvalConfig",
    "FSDPConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "ProfileConfig",
    "RunConfig",
    "SourceConfig",
    "TrainConfig",
    "WandbConfig",
    "all_keys",
    "build_section",
    "compiles",
    "deep_merge",
    "dump_yaml",
    "expand_home",
    "format_errors",
    "get_key",
    "load_config",
    "resolve_config_path",
    "run_defining_keys",
    "save_config",
    "shipped_config_dir",
    "short",
    "to_dict",
    "validate",
    "with_changes",
]
