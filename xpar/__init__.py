"""xpar: declarative experiments for training parallelism."""
__version__ = "0.1.0"

LAZY_IMPORTS = {
    # importing module: {module it imports inside a function: the library it would pull in at import time}
    "xpar.__main__": {"xpar.track.compare": "pandas", "xpar.calibrate.command": "torch"},
    "xpar.track.sweep": {"xpar.track.parent_run": "pandas"},
    "xpar.run.job": {"xpar.run.launch": "torch", "xpar.run.worker": "torch"},
    "xpar.run.forkserver": {"xpar.run.worker": "torch"},
    "xpar.run.checkpoint": {"xpar.parallel.optim": "torch"},
    "xpar.run.dryrun": {"xpar.parallel.factory": "torch", "xpar.parallel.mesh": "torch",
                        "xpar.parallel.memory_accounting": "torch"},
}
"""The only imports of xpar's own modules inside functions, and why: each would pull torch or pandas
(mlflow's run tables) into the command line's fast path (``xpar --help``, ``xpar plan``) or the
torch-free cost model. Every other xpar import is at its module's top; third-party imports inside
functions are torch, mlflow, matplotlib and pandas only. tests/test_imports.py keeps this list
exact and at most 20 imports."""
