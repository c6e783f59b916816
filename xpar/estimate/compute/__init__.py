"""Compute: seconds of work on one device. ``flops`` (FLOPs per token, for MFU and the estimate),
``kernels`` (one kernel from its shape and dtype), ``kernel_block`` (a block's kernels),
``kernel_costs`` (a layer's seconds per micro-batch from them), ``host`` (the CPU's time issuing work)."""
