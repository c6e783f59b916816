"""The analytic cost model (step time, memory, MFU) for layouts beyond this machine. Map:

- ``terms``: the one registry of keys; ``cost`` one layout, ``columns/`` many (``xpar plan``);
- compute: ``flops`` (FLOPs per token), ``cost.layer_costs`` (matmul and memory-bound seconds);
- memory: ``memory`` (peak per device), ``model_states``, ``activations``, ``offload`` (host);
- communication: ``collectives`` (alpha-beta), ``comm`` (bytes), ``dp`` and ``overlap`` (the ZeRO
  timeline); schedule: ``schedule`` (bubble, action lists); host: ``host`` (CPU dispatch);
- parallel axes: ``context_parallel``, ``expert_parallel``; framework-specific: ``deepspeed_zero3``;
- beside the model: ``report``, ``bubble``, ``timing`` (measured runs' figures), ``fidelity``,
  ``figures``, ``preflight`` (the memory check before a run), ``duration``, ``dryrun``, ``estimate_mode`` (the
  estimate-mode driver).

May import :mod:`xpar.config`, :mod:`xpar.models` and :mod:`xpar.parallel` (the dry run builds
the real engine on meta tensors); nothing above (tests/config/test_layout.py).
"""
