"""Typed configuration: msgspec sections (the schema, one module per consumer) mirrored by the Hydra
YAML files in `configs/`, composed with dotted overrides and checked at start-up.

Each role takes its own section whole: `model`, `engine` (generators), `sampling` (the behaviour
distribution: engines and learners), `task` (the prompt source), `algorithm` (the assembler, and
what the roles share), `policy` (the policy learner), `critic` (the value learner), `reward`
(reward endpoints), `trainer` (the run), `cluster` (where the roles run), `serve`, `offline`.
Defaults live in the sections; `configs/` holds the recipes. A section is the settings object its
builder passes: nothing copies it into another class.
"""

from asyncrl.config.algorithm import (Advantage, AlgorithmConfig, DrGRPOAdvantage, DynamicSampling, GAEAdvantage,
                                      GRPOAdvantage, KLPenalty, OverlongShaping, PairwiseAdvantage,
                                      ReinforcePlusPlusAdvantage, RLOOAdvantage)
from asyncrl.config.checks import ConfigError, route_checks, validate
from asyncrl.config.compose import SECRET_FIELDS, compose, config_from_dict, to_dict, to_record, to_yaml
from asyncrl.config.fields import NO_BOUND
from asyncrl.config.files import config_dir, config_groups
from asyncrl.config.learner import (Compute, CriticConfig, CriticWarmup, Optimizer, PolicyCompute, PolicyConfig,
                                    PolicyLoss, ValueLoss)
from asyncrl.config.model import EngineConfig, ModelConfig, SamplingConfig
from asyncrl.config.names import FOREIGN
from asyncrl.config.renames import RENAMED
from asyncrl.config.reward import (Endpoint, GenerativeJudgeEndpoint, OpenAIJudgeEndpoint, ProcessRewardEndpoint,
                                   PythonRewardEndpoint, RewardConfig, RouteConfig, ScalarRewardEndpoint,
                                   VerifierEndpoint)
from asyncrl.config.run import ClusterConfig, Config, DQOConfig, OfflineConfig, ServeConfig, TrainerConfig
from asyncrl.config.task import CurriculumStage, EnvironmentConfig, TaskConfig

__all__ = [
    "Advantage", "AlgorithmConfig", "ClusterConfig", "Compute", "Config", "ConfigError", "CriticConfig",
    "CriticWarmup", "CurriculumStage", "DQOConfig", "DrGRPOAdvantage", "DynamicSampling", "Endpoint", "EngineConfig",
    "EnvironmentConfig", "FOREIGN", "GAEAdvantage", "GRPOAdvantage", "GenerativeJudgeEndpoint", "KLPenalty",
    "ModelConfig", "NO_BOUND", "OfflineConfig", "OpenAIJudgeEndpoint", "Optimizer", "OverlongShaping", "PairwiseAdvantage", "PolicyCompute",
    "PolicyConfig", "PolicyLoss", "ProcessRewardEndpoint", "PythonRewardEndpoint", "RENAMED", "RLOOAdvantage", "ReinforcePlusPlusAdvantage",
    "RewardConfig", "SECRET_FIELDS", "RouteConfig", "SamplingConfig", "ScalarRewardEndpoint", "ServeConfig", "TaskConfig",
    "TrainerConfig", "ValueLoss", "VerifierEndpoint", "compose", "config_dir", "config_from_dict", "config_groups",
    "route_checks", "to_dict", "to_record", "to_yaml", "validate",
]
