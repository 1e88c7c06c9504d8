"""The executables' main: one lifecycle node on a single-threaded executor until shutdown (Ctrl-C)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import rclpy
from rclpy.exceptions import InvalidParameterTypeException
from rclpy.executors import Executor, ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node

# What to say with rclpy's refusal of an integer for a float parameter, made as the node is made.
FLOAT_PARAMETER_HINT = "write floats with a decimal point: 1.0, not 1"


def spin_node(make_node: Callable[[], Node], argv: list[str] | None = None) -> int:
    """rclpy.init with `argv` (sys.argv: --ros-args remaps and parameters), then spin `make_node()`."""
    rclpy.init(args=argv if argv is not None else sys.argv)
    try:
        node = make_node()
    except InvalidParameterTypeException as e:  # a params file's `1` for a float parameter: which, and how
        print(f"error: {e} ({FLOAT_PARAMETER_HINT})", file=sys.stderr)
        rclpy.shutdown()
        return 2
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        # Ctrl-C or SIGTERM (ros2 launch stopping) ends a lifecycle node as its shutdown transition would:
        # destroy_node alone runs none of it, and rmuscle_node would lose the episode in progress, which
        # its shutdown records into the library. Run again after a shutdown transition, it does nothing.
        shutdown = getattr(node, "on_shutdown", None)
        if callable(shutdown):
            try:
                shutdown(None)
            except Exception as e:  # the process is ending: say why the node's own shutdown failed
                print(f"{node.get_name()}: shutdown failed: {type(e).__name__}: {e}", file=sys.stderr)
        executor.shutdown()
        node.destroy_node()
        if rclpy.ok():
            rclpy.shutdown()
    return 0


class BackgroundSpin:
    """An executor spinning in a daemon thread, for a program that drives nodes from its main thread (the
    demo, the tests). `stop` shuts the executor down and joins the thread before the caller destroys any
    node: destroyed under a spinning executor, a node's handles raise InvalidHandle in that thread."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.thread = threading.Thread(target=executor.spin, daemon=True)
        self.thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.executor.shutdown()
        self.thread.join(timeout=timeout_s)
