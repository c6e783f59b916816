"""Communication: bytes and seconds on the links. ``collectives`` (alpha-beta time of one collective on
a group), ``volume`` (bytes per device per step), ``dp`` (data-parallel communication unit by unit and
what is exposed), ``overlap`` (the pass's timeline of compute and communication), ``hsdp``
(hierarchical ZeRO)."""
