"""`python -m primejax.eval --config configs/x.py --weights DIR`: offline evaluation (primejax/eval/offline.py)."""

from primejax.config.cli import run_main
from primejax.eval.offline import main

if __name__ == "__main__":
    run_main(main)
