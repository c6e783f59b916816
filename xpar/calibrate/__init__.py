"""Calibration: ``xpar calibrate`` measures this machine (matmul, memory bandwidth, collectives)
and writes a hardware preset (:mod:`~xpar.calibrate.command`); :mod:`~xpar.calibrate.published`
builds the published layouts the cost model's constants are fitted and checked on.

The top layer below the command line: may import every other package (tests/config/test_layout.py).
"""
