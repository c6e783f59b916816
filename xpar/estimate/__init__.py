"""Analytic cost model: memory, FLOPs, communication and schedule, for layouts beyond this machine."""
