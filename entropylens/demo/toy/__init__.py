"""The built-in toy RL lab: a tiny Qwen2-style policy learning a synthetic verifiable task.

from entropylens.demo.toy import config_for, train
train(config_for("ce_gppo", steps=50), "runs")
"""

from .config import DEMO_DEFAULT, RUNS, ToyConfig, config_for, run_names
from .train import RunResult, train

__all__ = ["ToyConfig", "RUNS", "DEMO_DEFAULT", "config_for", "run_names", "train", "RunResult"]
