"""bench/trace_graphs.py's accounting of a traced graph replay: with programmatic dependent launch kernels
overlap (each starts early and waits), so each is charged from its predecessor's end to its own end, idle
time goes to the kernel after it, and charged time plus gaps is the replay's span."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trace_graphs import charge, idle_gaps, kernel_events, layer_step_positions, sequence


def test_overlapping_kernels_are_charged_their_own_tail_and_gaps_add_up() -> None:
    trace = {
        "traceEvents": [
            {"cat": "kernel", "name": "b_kernel(int)", "ts": 3.0, "dur": 5.0},  # starts early, waits for a
            {"cat": "kernel", "name": "a_kernel<float>(x)", "ts": 0.0, "dur": 4.0},
            {"cat": "gpu_memset", "name": "Memset", "ts": 10.0, "dur": 1.0},  # after a 2 µs gap
            {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 50.0},  # host events are ignored
        ]
    }
    events = kernel_events(trace)
    assert [e[0] for e in events] == ["a_kernel<float>(x)", "b_kernel(int)", "Memset"]
    r = charge(events)
    k = r["by_kernel"]
    assert k["a_kernel"]["charged_us"] == pytest.approx(4.0)
    assert k["b_kernel"]["charged_us"] == pytest.approx(4.0)  # 4 → 8, not its whole 5 µs
    assert k["Memset"]["gap_us"] == pytest.approx(2.0) and k["Memset"]["charged_us"] == pytest.approx(1.0)
    assert r["span_us"] == pytest.approx(sum(v["charged_us"] + v["gap_us"] for v in k.values()))


def test_idle_gaps_list_each_stretch_without_gpu_work() -> None:
    events = [("a", 0.0, 4.0), ("b", 3.0, 8.0), ("c<x>", 10.0, 11.0), ("d", 11.5, 12.0)]
    assert idle_gaps(events) == [
        {"us": 2.0, "at_us": 8.0, "before": "c"},
        {"us": 0.5, "at_us": 11.0, "before": "d"},
    ]


def test_sequence_lists_events_in_order_with_the_idle_gap_before_each() -> None:
    events = [("a", 0.0, 4.0), ("b(int)", 3.0, 8.0), ("c<x>", 10.0, 11.0)]
    assert sequence(events) == [
        {"name": "a", "start_us": 0.0, "dur_us": 4.0, "gap_us": 0.0},
        {"name": "b", "start_us": 3.0, "dur_us": 5.0, "gap_us": 0.0},  # overlaps a (PDL): no gap
        {"name": "c", "start_us": 10.0, "dur_us": 1.0, "gap_us": 2.0},
    ]


def test_layer_step_positions_separate_the_anchor_step_from_the_later_ones() -> None:
    # 2 steps × 2 layers of [qkv_rope, add_norm], 1 µs each in the first step, 2 µs later; the step
    # kernel between steps is not a layer kernel and is left out.
    events, t = [], 0.0
    for step in range(2):
        for _ in range(2):
            for name in ("_skinny_qkv_rope_kernel", "_add_norm_kernel"):
                events.append((name, t, t + 1.0 + step))
                t += 1.0 + step
        events.append(("_action_step_row_kernel", t, t + 5.0))
        t += 5.0
    rows = layer_step_positions(events, steps=2, depth=2)
    assert [r["kernel"] for r in rows] == ["_skinny_qkv_rope_kernel", "_add_norm_kernel"]
    assert [(r["first_step_us"], r["later_steps_us"]) for r in rows] == [(1.0, 2.0), (1.0, 2.0)]
    assert layer_step_positions(events[:-2], steps=2, depth=2) is None  # not whole layer-steps


def test_compare_traces_lists_each_position_and_the_span_for_stages_traced_in_both() -> None:
    from bench.compare_traces import layer_step_deltas

    def trace(commit: str, later: list[float], span: float) -> dict:
        rows = [{"position": i, "kernel": f"k{i}", "later_steps_us": v} for i, v in enumerate(later)]
        return {"commit": commit, "results": {"denoise": {"span_us": span, "layer_step": rows},
                                              "vision": {"span_us": 1.0}}}  # fmt: skip

    out = layer_step_deltas(trace("a", [3.0, 5.0], 6000.0), trace("b", [2.5, 5.5], 5900.0))
    assert list(out) == ["denoise"]  # vision has no layer-step table
    assert [(r["position"], r["delta_us"]) for r in out["denoise"]] == [(0, -0.5), (1, 0.5), ("span", -0.1)]
