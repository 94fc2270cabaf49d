"""`python -m primejax.sft --config configs/x.py`: supervised fine-tuning (see primejax/sft/loop.py)."""

from primejax.config.cli import run_main
from primejax.sft.loop import main

if __name__ == "__main__":
    run_main(main)
