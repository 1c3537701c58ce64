"""Scenario environments for CLaaS: interface, built-in rule env, IH-Challenge JSONL, ICL state."""

from claas_verl.claas.envs.base import (
    DEFAULT_MAX_TURNS,
    Grade,
    GraderError,
    Scenario,
    Verdict,
    Verifier,
    grade_response,
    user_context,
)
from claas_verl.claas.envs.environment import Environment
from claas_verl.claas.envs.factory import make_environment
from claas_verl.claas.envs.icl import ICLFeedbackMemory
from claas_verl.claas.envs.ih_challenge import IHChallengeEnv, load_ih_challenge_jsonl, parse_scenario
from claas_verl.claas.envs.rule_following import RuleFollowingEnv, RuleSetVerifier
from claas_verl.claas.envs.sandboxed import SandboxedVerifier
from claas_verl.claas.envs.stream import ScenarioStream
from claas_verl.claas.envs.thinking import strip_thinking
from claas_verl.sandbox import (
    CallTest,
    GraderPool,
    GraderSandbox,
    IOTest,
    ProgramResult,
    SandboxLimits,
    SandboxUnavailable,
    run_program,
)

__all__ = [
    "CallTest", "IOTest", "ProgramResult", "SandboxUnavailable", "run_program",
    "DEFAULT_MAX_TURNS", "Environment", "Grade", "GraderError", "GraderPool", "GraderSandbox", "ICLFeedbackMemory",
    "IHChallengeEnv", "RuleFollowingEnv", "RuleSetVerifier", "SandboxLimits", "SandboxedVerifier", "Scenario",
    "ScenarioStream", "Verdict", "Verifier", "grade_response", "load_ih_challenge_jsonl", "make_environment",
    "parse_scenario",
    "strip_thinking", "user_context",
]
