"""Typed configuration: dataclasses (the schema, one module per consumer) mirrored by the Hydra
YAML files in `configs/`, composed with dotted overrides and checked at start-up.

Each role takes its own section whole: `model`, `engine` (generators), `task` (the prompt
source), `algorithm` (the assembler, and what the roles share), `policy` (the policy learner),
`critic` (the value learner), `reward` (reward endpoints), `trainer` (the run), `cluster` (where
the roles run), `serve`, `offline`. Defaults live in the dataclasses; `configs/` holds the recipes.
"""

from asyncrl.config.algorithm import AlgorithmConfig, CriticConfig, PolicyConfig
from asyncrl.config.checks import (BEHAVIOUR_CORRECTIONS, ENDPOINT_KINDS, FILTER_METRICS, KL_ESTIMATORS, LOSS_AGG_MODES,
                                   MODES, ConfigError, route_checks, validate)
from asyncrl.config.compose import RENAMED, SECRET_FIELDS, compose, config_from_dict, to_dict, to_record
from asyncrl.config.files import config_dir, config_groups
from asyncrl.config.model import EngineConfig, ModelConfig
from asyncrl.config.reward import EndpointConfig, RewardConfig, RouteConfig
from asyncrl.config.run import ClusterConfig, Config, OfflineConfig, ServeConfig, TrainerConfig
from asyncrl.config.task import CurriculumStage, EnvironmentConfig, TaskConfig

__all__ = [
    "AlgorithmConfig", "BEHAVIOUR_CORRECTIONS", "ClusterConfig", "Config", "ConfigError", "CriticConfig",
    "CurriculumStage", "ENDPOINT_KINDS", "EndpointConfig", "EngineConfig", "EnvironmentConfig", "FILTER_METRICS", "KL_ESTIMATORS",
    "LOSS_AGG_MODES", "MODES", "ModelConfig", "OfflineConfig", "PolicyConfig", "RENAMED", "RewardConfig",
    "RouteConfig", "ServeConfig", "TaskConfig", "TrainerConfig", "compose", "config_dir", "config_from_dict",
    "config_groups", "route_checks", "to_dict", "to_record", "SECRET_FIELDS", "validate",
]
