"""polo.control: REINFORCE, A2C, TRPO, PPO and critic-free GRPO on Gymnasium, from polo.core."""

from polo.control.config import ControlConfig, load_control_config
from polo.control.trainer import ALGORITHMS, ControlResult, train

__all__ = ["ALGORITHMS", "ControlConfig", "ControlResult", "load_control_config", "train"]
