"""What the Lightning tests share: a quiet one-device CPU trainer, a one-layer module trained by
SGD, and a callback that checkpoints mid-epoch. Import it after
``pytest.importorskip("lightning.pytorch")``."""

import lightning.pytorch as lightning
import torch


def cpu_trainer(**kwargs) -> lightning.Trainer:
    """A trainer on one CPU device that writes nothing of its own (no logger, checkpoints,
    progress bar or model summary); ``kwargs`` go to ``lightning.Trainer`` (a ``logger``
    given replaces none)."""
    quiet = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    return lightning.Trainer(**(quiet | kwargs))


class LinearModule(lightning.LightningModule):
    """One linear layer of ``features`` inputs and its SGD optimizer; subclasses record what
    their steps see."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(features, 1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class CheckpointAt(lightning.Callback):
    """Saves a checkpoint to ``path`` after global step ``step`` (mid-epoch, for resume)."""

    def __init__(self, step: int, path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)
