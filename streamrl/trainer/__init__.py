"""The trainer: optimizer steps on batches of groups (`Trainer`), the losses, and the run loop's async
handle on it (`start_trainer`: its own process on CPU, a worker thread on a GPU)."""

from .losses import group_advantages, policy_loss
from .process import TrainerFailed, TrainerProcess, TrainerThread, start_trainer
from .trainer import Trainer

__all__ = ["Trainer", "TrainerFailed", "TrainerProcess", "TrainerThread", "group_advantages", "policy_loss",
           "start_trainer"]
