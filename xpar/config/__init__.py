"""What a run is: the structured config schema, presets, command-line overrides, validation and
its checks, the resolved :class:`~xpar.config.spec.RunSpec` and the :class:`~xpar.config.layout.Layout`
that owns every layout rule.

The bottom layer: imports nothing else of xpar and never imports torch (tests/config/test_layout.py).
"""
