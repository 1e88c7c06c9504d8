"""The executables' main: one lifecycle node on a single-threaded executor until shutdown (Ctrl-C)."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import rclpy
from rclpy.clock import Clock, ClockType
from rclpy.exceptions import InvalidParameterTypeException
from rclpy.executors import Executor, ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.timer import Timer

# What to say with rclpy's refusal of an integer for a float parameter, made as the node is made.
FLOAT_PARAMETER_HINT = "write floats with a decimal point: 1.0, not 1"


def periodic_timer(node: Node, period_s: float, callback: Callable[[], None]) -> Timer:
    """A timer that keeps its period whatever happens to the system clock.

    With `use_sim_time` it runs on the node's clock, so it follows /clock (a simulator, a bag player).
    Otherwise it runs on the steady clock: rcl's timers on the system clock do not notice the clock being
    stepped (chrony or NTP correcting it, a Jetson without an RTC battery setting its time after boot),
    and a step back of N seconds stopped the timer for N seconds (found in review). The callback still
    reads the node's clock for the time it stamps and schedules by."""
    if node.get_clock().ros_time_is_active:
        return node.create_timer(period_s, callback)
    return node.create_timer(period_s, callback, clock=Clock(clock_type=ClockType.STEADY_TIME))


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
        # A second Ctrl-C meanwhile (the write of a long episode takes a while) is said and ignored: it
        # ended the write, the episode and the teardown (SIGKILL still ends the process).
        name = node.get_name()
        held = _hold_signals(name)
        try:
            shutdown = getattr(node, "on_shutdown", None)
            if callable(shutdown):
                try:
                    shutdown(None)
                except Exception as e:  # the process is ending: say why the node's own shutdown failed
                    print(f"{name}: shutdown failed: {type(e).__name__}: {e}", file=sys.stderr)
        finally:
            executor.shutdown()
            node.destroy_node()
            if rclpy.ok():
                rclpy.shutdown()
            _restore_signals(held)
    return 0


def _hold_signals(name: str) -> dict[int, Any]:
    """Until _restore_signals: SIGINT and SIGTERM print what the node is doing instead of interrupting it.
    Only the main thread may set handlers; elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def say(signum: int, _frame: object) -> None:
        print(
            f"{name}: {signal.Signals(signum).name} ignored: shutting down, recording the episode in progress "
            "into the library (SIGKILL ends the process without it)",
            file=sys.stderr,
            flush=True,
        )

    return {s: signal.signal(s, say) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore_signals(held: dict[int, Any]) -> None:
    for signum, handler in held.items():
        if handler is not None:  # None: set outside Python, which cannot be put back from here
            signal.signal(signum, handler)


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
        if self.thread.is_alive():  # a callback that does not return: destroying nodes now may fail in it
            print(
                f"warning: the executor's thread is still running {timeout_s:g} s after its shutdown",
                file=sys.stderr,
            )
