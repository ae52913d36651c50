"""torchrun's training script for ``ckpt train`` (run by path; see the package docstring)."""

from ckpt.trainer.worker import main

if __name__ == "__main__":
    main()
