"""The launcher process (`python -m primejax.train`): checks the input, settles what to resume from, starts
the inference server, orchestrator and trainer of one run and watches them."""

from primejax.launcher.launch import launch

__all__ = ["launch"]
