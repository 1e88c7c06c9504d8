"""The executables' main: one lifecycle node on a single-threaded executor until shutdown (Ctrl-C)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import rclpy
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node


def spin_node(make_node: Callable[[], Node], argv: list[str] | None = None) -> int:
    """rclpy.init with `argv` (sys.argv: --ros-args remaps and parameters), then spin `make_node()`."""
    rclpy.init(args=argv if argv is not None else sys.argv)
    node = make_node()
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        executor.shutdown()
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0
