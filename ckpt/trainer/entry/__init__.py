"""The torchrun entry script lives alone in this package: torchrun runs it by path, so the first
entry of the workers' ``sys.path`` is this directory, not the caller's working directory (where a
folder named ``ckpt`` would otherwise shadow the installed package)."""
