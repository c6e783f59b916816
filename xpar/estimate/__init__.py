"""The analytic cost model (step time, memory, MFU) for layouts beyond this machine. Map:

- ``cost`` one layout (``run.mode=estimate``), ``columns/`` many at once (``xpar plan``; one layout
  is a column of one); ``step_parts`` the parts a step is assembled from; ``terms`` the one registry;
- ``compute/``: FLOPs, kernels, a block's and a layer's seconds, the host's issue time;
- ``memory/``: the peak per device, model states, activations, buffers, offload to the host;
- ``comm/``: collectives (alpha-beta), bytes per step, dp's timeline and overlap, hierarchical ZeRO;
- ``schedule``: bubbles, action lists; ``context_parallel``, ``expert_parallel``, ``moe_dispatch``: cp, ep;
- ``frameworks/``: one framework's own behaviour (DeepSpeed's ZeRO, Megatron-Core's overlap, FP8);
- not the model: ``preflight/`` (the memory and duration checks before a run). A run's report,
  bubble and timing live in :mod:`xpar.track`; estimate mode, the dry run and fidelity in :mod:`xpar.run`.

May import :mod:`xpar.config`, :mod:`xpar.models` and :mod:`xpar.parallel` (torch-free helpers:
schedule actions, ring factors); nothing above (tests/config/test_layout.py).
"""
