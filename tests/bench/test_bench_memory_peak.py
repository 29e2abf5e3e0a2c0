"""bench.memory_peak: the peak of an allocator trace and the live blocks at it, grouped by source line."""

from bench.memory_peak import MIB, peak_breakdown


def _frames(path: str, line: int, name: str) -> list[dict]:
    # innermost first, as the allocator records them; torch's own frame comes before ours
    return [
        {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
        {"filename": path, "line": line, "name": name},
    ]


def test_the_peak_is_where_the_running_total_is_highest_and_counts_the_blocks_alive_there():
    a = _frames("/repo/engine/fastpath/lora.py", 10, "forward")
    b = _frames("/repo/engine/kernels/fused_ce.py", 20, "fused_ce")
    trace = [
        {"action": "alloc", "addr": 1, "size": 4 * MIB, "frames": a},
        {"action": "alloc", "addr": 2, "size": 2 * MIB, "frames": a},
        {"action": "free_requested", "addr": 1, "size": 4 * MIB},
        {"action": "free_completed", "addr": 1, "size": 4 * MIB},
        {"action": "alloc", "addr": 3, "size": 3 * MIB, "frames": b},  # 2 + 3: below the first peak (6)
        {"action": "alloc", "addr": 4, "size": 5 * MIB, "frames": []},  # 10: the peak
        {"action": "free_completed", "addr": 4, "size": 5 * MIB},
        # a block allocated before the recording: freeing it lowers the total below held_before
        {"action": "free_completed", "addr": 99, "size": 1 * MIB},
    ]
    out = peak_breakdown(trace, held_before=100 * MIB)
    assert out["peak_gib"] == round(110 * MIB / (1 << 30), 3)
    assert out["set_by"] == "(no Python frame: autograd engine / C++)"
    rows = dict((w, m) for w, m in out["lines_mib"])
    assert rows["held before the step"] == 100.0
    assert rows["engine/fastpath/lora.py:10 forward"] == 2.0
    assert rows["engine/kernels/fused_ce.py:20 fused_ce"] == 3.0
    assert rows["(no Python frame: autograd engine / C++)"] == 5.0
    # largest first after the line for what was held before
    assert [m for _, m in out["lines_mib"][1:]] == [5.0, 3.0, 2.0]


def test_lines_beyond_top_are_summed_into_one():
    trace = [{"action": "alloc", "addr": i, "size": MIB, "frames": _frames("/r/engine/x.py", i, "f")} for i in range(5)]
    out = peak_breakdown(trace, held_before=0, top=2)
    assert out["lines_mib"][-1] == ["3 more lines", 3.0]
    assert len(out["lines_mib"]) == 4
