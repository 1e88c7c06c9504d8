"""A/B control for the node's wake after a tick (`bench/device_run.sh … node_soak_ab`).

On PYTHONPATH, this keeps Python's thread switch interval at its default (5 ms) whatever the process
asks: `rmuscle_node` shortens it from a tick until its worker runs (`WAKE_SWITCH_INTERVAL_S`), and with
this the same node code runs without that. Not imported by anything else.
"""

import sys

_DEFAULT_S = sys.getswitchinterval()
_set = sys.setswitchinterval


def _at_least_default(interval: float) -> None:
    _set(max(interval, _DEFAULT_S))


sys.setswitchinterval = _at_least_default
