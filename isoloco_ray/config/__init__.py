"""Every user-facing setting of a training run, validated with pydantic.

`TrainConfig` is what `python -m isoloco_ray.train` builds from its defaults, an optional YAML
file and `--section.field=value` flags. Fields left at `None` are filled from presets after
validation (model size from `model.preset`; learning rates, momentum and merge options from the
outer strategy's paper values in the registry, isoloco_ray/strategies.py), so a resolved config
has no `None` left where a number is needed and is what checkpoints and summaries record.

schema.py holds the sections and presets, train_config.py `TrainConfig` (how the sections
check each other and are resolved), resolved.py the settled values typed as set (what the
workers read), loading.py the YAML and command-line loading and `ConfigError`, resume.py what
a resume may change. The names below are the package's API.
"""

from isoloco_ray.config.loading import (
                                        CLI_DESCRIPTION,
                                        CLI_NONE,
                                        NULL_SPELLINGS,
                                        ConfigError,
                                        build_config,
                                        field_paths,
                                        flatten,
                                        format_validation_error,
                                        load_config,
                                        merge_nested,
                                        nest,
                                        optional_field_paths,
                                        parse_cli_overrides,
                                        read_yaml_config,
                                        setting_paths,
)
from isoloco_ray.config.resolved import ModelShape, Resolved, settled
from isoloco_ray.config.resume import RESUME_MAY_CHANGE, RESUME_MUST_MATCH, config_differences
from isoloco_ray.config.schema import (
                                        MODEL_PRESETS,
                                        NAME_MAX_LEN,
                                        NAME_PATTERN,
                                        DataConfig,
                                        InnerConfig,
                                        ModelConfig,
                                        ModelPreset,
                                        OuterConfig,
                                        RunConfig,
                                        ScalingConfig,
                                        WandbConfig,
                                        check_name,
                                        path_text,
)
from isoloco_ray.config.train_config import TrainConfig

__all__ = ["CLI_DESCRIPTION", "CLI_NONE", "MODEL_PRESETS", "NAME_MAX_LEN",
           "NAME_PATTERN", "NULL_SPELLINGS", "RESUME_MAY_CHANGE",
           "RESUME_MUST_MATCH", "ConfigError", "DataConfig", "InnerConfig",
           "ModelConfig", "ModelPreset", "ModelShape", "OuterConfig", "Resolved",
           "RunConfig", "ScalingConfig", "TrainConfig", "WandbConfig",
           "build_config", "check_name", "config_differences", "field_paths", "flatten",
           "format_validation_error", "load_config", "merge_nested", "nest",
           "optional_field_paths", "parse_cli_overrides", "path_text",
           "read_yaml_config", "setting_paths", "settled"]
