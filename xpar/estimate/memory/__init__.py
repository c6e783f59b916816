"""Memory: bytes per device. ``per_device`` (the peak of a layout and its terms), ``model_states``
(parameters, gradients, optimizer states; :class:`MemoryOptions`), ``activations`` (saved per layer,
stage and schedule), ``buffers`` (communication and sharding buffers), ``offload`` (an optimizer
step on the host: its time and host memory)."""
